"""scripts/gpu_check.sh --cpu: the GPU check's every step, on the CPU with tiny sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_mode_runs_every_check(tmp_path):
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu"], env=env, capture_output=True,
                       text=True, timeout=480)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    for name in ("single", "wan2", "units", "bubbletea"):
        assert f"gpu_check {name}: ok" in r.stdout, r.stdout
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| block |" in report and "CPU fp32 loss" in report
