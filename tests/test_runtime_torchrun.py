"""Under torchrun, `--wan auto` runs the plan's WAN mechanisms over the real network.

One torchrun launch of the tiny 2-DC plan (pp=2 x dp=2): every cross-DC link is carried by
StripedTransport bound to the address towards MASTER_ADDR, with the plan's connection count, and
the rank logs say so; the losses equal the built-in launcher's `--wan off` run bit for bit (the
boundary tensors cross in the training dtype either way). `--serve-prefill` is refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.process import descendants
from geotrain.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def _torchrun(source: Path, *args: str, timeout: float = 240, nproc: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), "-m", "geotrain.cli", "train", str(source), *args],
                          env=ENV, capture_output=True, text=True, timeout=timeout)


# As root, tests/test_rehearse.py runs the same checks on a real two-host layout (one torchrun per
# emulated DC, c10d across the kernel WAN): this single-host launch is then skipped to keep the
# suite's time, and runs where namespaces are not available.
covered_by_rehearse = pytest.mark.skipif(os.geteuid() == 0, reason="as root, test_rehearse.py covers it over "
                                                                   "the kernel WAN with one torchrun per DC")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_2dc_builtin_run):
    tmp = tmp_path_factory.mktemp("torchrun")
    # The plan the built-in run trained (its RUN_DIR/plan.json): under torchrun a rank trains a plan file.
    r = _torchrun(tiny_2dc_builtin_run / "plan.json", "--steps", "3", "--wan", "auto", "--out", str(tmp / "auto"),
                  "--no-progress", "--data", "synthetic")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, r, tiny_2dc_builtin_run


@covered_by_rehearse
def test_auto_under_torchrun_uses_the_striped_transport_and_logs_it(runs):
    _, r, _ = runs
    lines = [ln for ln in r.stderr.splitlines() if "geotrain wan: rank" in ln]
    # pp=2 x dp=2: each of the 4 ranks has one cross-DC peer stage
    assert len(lines) == 4, r.stderr[-2000:]
    assert all("StripedTransport" in ln and "direct" in ln and "connections" in ln for ln in lines), lines
    # no GEOTRAIN_SECRET_FILE: the secret went through the c10d store, and rank 0 said so, once
    assert r.stderr.count("the run secret is shared through the rendezvous store") == 1, r.stderr[-2000:]


@covered_by_rehearse
def test_auto_under_torchrun_trains_like_the_built_in_launcher(runs):
    tmp, _, off = runs
    auto = _losses(tmp / "auto")
    assert len(auto) == 3 and auto == _losses(off)


def test_serve_prefill_under_torchrun_is_refused_in_one_line(tmp_path):
    # refused before the process group forms: one rank shows it
    r = _torchrun(SPEC, "--steps", "1", "--serve-prefill", "0", "--out", str(tmp_path / "x"), timeout=120, nproc=1)
    assert r.returncode != 0
    assert "--serve-prefill is not available under torchrun" in r.stderr


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"geotrain.cli" in cmd:
            return pid
    return None


@pytest.mark.slow
def test_the_outage_limit_holds_under_torchrun(tmp_path):
    """--outage-limit 5 under torchrun: when the peer across the WAN stops answering (SIGSTOP: its sockets
    stay open), the waiting rank fails within seconds of the limit, naming that peer -- it used to wait the
    transport's 300 s default (and a process group's 600 s)."""
    import signal
    import threading
    import time

    from geotrain.layout.plan import StagePlan, save_plan
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec.load import load_spec

    spec = load_spec(ROOT / "examples" / "tiny_2dc_pp2.toml")
    base = plan_from_job(spec)
    plan = base.with_(stages=(StagePlan(dc="east", chunks=base.stages[0].chunks),      # one stage per DC:
                              StagePlan(dc="west", chunks=base.stages[1].chunks)), links=())   # the WAN between
    save_plan(tmp_path / "plan.json", plan, spec=spec)
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "geotrain.cli",
                          "train", str(tmp_path / "plan.json"), "--steps", "500", "--wan", "auto",
                          "--outage-limit", "5", "--out", str(out), "--no-progress", "--data", "synthetic"],
                         env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), ln) for ln in p.stderr), daemon=True)
    reader.start()
    stopped = None
    try:
        deadline = time.time() + 150
        while not (out / "losses.jsonl").exists() or not (out / "losses.jsonl").read_text().strip():
            assert p.poll() is None and time.time() < deadline, "".join(ln for _, ln in lines)[-3000:]
            time.sleep(0.2)
        stopped = _rank_pid(p.pid, 0)             # stage 0 (east): stage 1's only peer
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.time()
        while time.time() - t0 < 60 and not any("no answer within 5 s" in ln or "timed out after 5 s" in ln
                                                 for _, ln in lines):
            time.sleep(0.2)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        for pid in descendants(p.pid) if p.poll() is None else ():   # the ranks lead their own sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.kill()
        p.wait(timeout=60)
        reader.join(10)
    err = "".join(ln for _, ln in lines)
    hit = [(t, ln) for t, ln in lines if "no answer within 5 s" in ln or "timed out after 5 s" in ln]
    assert hit, err[-3000:]
    assert hit[0][0] - t0 < 5 + 20, (hit[0][0] - t0, err[-3000:])
    assert "rank 0 (east)" in hit[0][1] or "rank(s) 0" in hit[0][1], hit[0][1]


def test_a_rank_never_plans_a_toml_under_torchrun_is_refused_in_one_line(tmp_path):
    r = _torchrun(SPEC, "--steps", "1", "--out", str(tmp_path / "x"), timeout=120, nproc=1)
    assert r.returncode != 0, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if "geotrain train: error:" in x]
    assert len(lines) == 1 and "none plans: make it once (`geotrain plan" in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "x").exists()
