"""scripts/gpu_check.sh: its set-up (the interpreter, the shipped wheels), its verdicts, and the whole check on
the CPU with tiny sizes -- on the oldest supported torch without pydantic where scripts/test.sh made that
interpreter (.venv-torch211: the GPU machine's situation), else on this one."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod             # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gpu_check, gpu_deps = _load("gpu_check"), _load("gpu_deps")


def _torch211() -> str | None:
    """The oldest-torch interpreter scripts/test.sh made (no pydantic, like the GPU machine), if any."""
    for p in (os.environ.get("GEOTRAIN_TORCH211_PYTHON"), str(ROOT / ".venv-torch211" / "bin" / "python")):
        if p and Path(p).exists():
            return p
    return None


def _run(tmp_path: Path, python: str, *extra: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), "GPU_CHECK_DEPS": str(tmp_path / "deps"),
           "PYTHON": python, "GPU_CHECK_TIMEOUT": "840", **env}       # a loaded 2-core machine: 5-8 min
    env.pop("PYTHONPATH", None)          # the machine's own interpreter, as on the GPU box
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", *extra], env=env,
                          capture_output=True, text=True, timeout=870)


def test_the_shipped_wheels_cover_what_is_needed():
    """NEEDED + OPTIONAL are pyproject's dependencies (torch aside); every needed package this interpreter
    lacks on the GPU machine (pydantic and friends) has a wheel for CPython 3.12 in scripts/wheels."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {gpu_deps.parse_req(d)[0] for d in deps if gpu_deps.parse_req(d) and not d.startswith("torch")}
    assert names == {gpu_deps.parse_req(d)[0] for d in gpu_deps.NEEDED + gpu_deps.OPTIONAL}
    wheels = {gpu_deps.norm(w.name.split("-")[0]) for w in (ROOT / "scripts" / "wheels").glob("*.whl")}
    assert {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "fastapi", "starlette",
            "uvicorn"} <= wheels
    assert any("cp312" in w.name for w in (ROOT / "scripts" / "wheels").glob("pydantic_core-*.whl"))
    assert sum(w.stat().st_size for w in (ROOT / "scripts" / "wheels").glob("*.whl")) < 8 * 2**20


def test_missing_packages_and_no_wheel_are_one_line(tmp_path):
    python = _torch211()
    if python is None:
        pytest.skip("needs an interpreter without pydantic (.venv-torch211, made by scripts/test.sh)")
    (tmp_path / "empty").mkdir()
    r = _run(tmp_path, python, GPU_CHECK_WHEELS=str(tmp_path / "empty"))
    assert r.returncode == 3
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: missing pydantic"), r.stderr


def test_no_torch_is_one_line(tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    r = _run(tmp_path, str(venv / "bin" / "python"))
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert re.match(r"gpu_check: this Python \(.*\) has no usable torch", r.stderr.strip()), r.stderr


def test_every_check_can_fail():
    ok = {"loss": 2.0, "step": 1, "step_time_s": 0.1}
    worse = [{**ok, "step": 1, "loss": 5.0}, {**ok, "step": 2, "loss": 4.0}]
    assert gpu_check.single_verdict(worse, worse).ok
    assert not gpu_check.single_verdict(worse, [{**r, "loss": r["loss"] * 1.1} for r in worse]).ok
    times = {"embedding": (1e-4, 2e-4), "block": (1e-3, 2e-3), "head": (1e-3, 2e-3)}
    assert gpu_check.units_verdict(times, {"block": 0.4}, "gpu").ok
    assert not gpu_check.units_verdict(times, {"block": 1.7}, "gpu").ok        # faster than the datasheet's peak
    assert not gpu_check.units_verdict(times, {"block": 0.001}, "gpu").ok      # 400x slower: not on the GPU
    assert not gpu_check.units_verdict({**times, "head": (0.0, 1e-3)}, {"block": 0.4}, "cpu").ok
    gpu = gpu_check.BUBBLETEA["gpu"]
    assert gpu_check.bubbletea_verdict({"ratio": 1.01, "answered": 3}, "gpu", gpu).ok
    assert not gpu_check.bubbletea_verdict({"ratio": 1.2, "answered": 3}, "gpu", gpu).ok      # slower with prefill
    assert not gpu_check.bubbletea_verdict({"ratio": 0.546, "answered": 3}, "gpu", gpu).ok    # noise, not a speed-up
    assert not gpu_check.bubbletea_verdict({"ratio": 1.0, "answered": 0}, "gpu", gpu).ok
    assert gpu_check.bubbletea_verdict({"ratio": 3.3, "answered": 1}, "cpu", None).ok         # shared cores
    assert not gpu_check.bubbletea_verdict({"ratio": 1.0, "answered": 0}, "cpu", None).ok
    row = {"run": "r", "layout": "l", "device": "d", "measured_s": 0.10, "predicted_s": 0.11, "measured_mem": 1e9,
           "predicted_mem": 1.05e9, "when": "now"}
    assert gpu_check.predict_verdict(row, gpu_check.PREDICT["gpu"]).ok
    assert not gpu_check.predict_verdict({**row, "predicted_s": 0.2}, gpu_check.PREDICT["gpu"]).ok   # 100 % off
    assert not gpu_check.predict_verdict({**row, "predicted_mem": 2e9}, gpu_check.PREDICT["gpu"]).ok
    assert gpu_check.predict_verdict({**row, "predicted_s": 0.2}, None).ok                          # CPU: the row
    assert not gpu_check.predict_verdict({**row, "measured_mem": None}, None).ok


@pytest.mark.slow
@pytest.mark.timeout(900)     # five steps: ~2 min quiet, 5-6 min under load ~25 (over the 300 s default)
def test_gpu_check_cpu_mode_runs_every_check(tmp_path):
    python = _torch211() or sys.executable
    # `shared` (four ranks on one GPU) is skipped here: tests/test_shared_gpu.py runs that path on both torches
    r = _run(tmp_path, python, "--skip", "shared")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| check | result |") and len(rows) == 2 + 5        # one table, five checks
    for name in ("single", "wan2", "units", "bubbletea", "predict"):
        assert any(ln.startswith(f"| {name} | ok |") for ln in rows), r.stdout
    if python != sys.executable:               # the GPU machine's situation: pydantic came from the shipped wheels
        assert re.search(r"gpu_check deps: unpacked \d+ shipped wheel\(s\) .*pydantic", r.stdout), r.stdout
        assert "torch 2.11" in r.stdout
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| block |" in report and "CPU fp32 loss" in report
    # the predict step's row, in the GPU validation's table format (bench/bench_validate_gpu.py --measured)
    from geotrain.calibrate.gpu_measured import load_measured, measured_markdown

    measured = load_measured(tmp_path / "out" / "gpu_measured.json")
    assert len(measured) == 1 and measured[0]["measured_s"] > 0 and measured[0]["predicted_s"] > 0
    assert measured_markdown(measured).splitlines()[2].startswith("| gpu_check single (tiny) |")
