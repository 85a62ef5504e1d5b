"""docs/API.md runs: its Python blocks, in order, in one namespace, from the repository's root --
the documented API (geotrain.load_spec / plan / simulate / train) cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_document_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "API.md").read_text(), flags=re.S)
    assert len(blocks) >= 4
    script = tmp_path / "api_doc.py"
    script.write_text("\n".join(blocks))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny-2dc tiny" in r.stdout and "tokens/s" in r.stdout


def test_import_geotrain_stays_light():
    """The API's names load on first use: importing the package pulls in none of torch, pydantic, numpy;
    asking for `geotrain.train` loads the training path (which itself leaves torch to the ranks:
    tests/test_architecture.py::test_the_launcher_imports_no_torch)."""
    code = ("import sys, geotrain; heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pydantic', "
            "'numpy')]; print('HEAVY', heavy); print(callable(geotrain.train), "
            "'geotrain.orchestrate.training_run' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in r.stdout and "True True" in r.stdout, r.stdout + r.stderr
