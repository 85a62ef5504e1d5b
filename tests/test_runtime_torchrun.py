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

from geotrain.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def _torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "geotrain.cli", "train", str(SPEC), *args],
                          env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    r = _torchrun("--steps", "3", "--wan", "auto", "--out", str(tmp / "auto"), "--no-progress", "--data", "synthetic")
    assert r.returncode == 0, r.stderr[-3000:]
    off = subprocess.run([sys.executable, "-m", "geotrain.cli", "train", str(SPEC), "--steps", "3", "--wan", "off",
                          "--out", str(tmp / "off"), "--no-progress", "--data", "synthetic"],
                         env=ENV, capture_output=True, text=True, timeout=240)
    assert off.returncode == 0, off.stderr[-3000:]
    return tmp, r


def test_auto_under_torchrun_uses_the_striped_transport_and_logs_it(runs):
    _, r = runs
    lines = [ln for ln in r.stderr.splitlines() if "geotrain wan: rank" in ln]
    # pp=2 x dp=2: each of the 4 ranks has one cross-DC peer stage
    assert len(lines) == 4, r.stderr[-2000:]
    assert all("StripedTransport" in ln and "direct" in ln and "connections" in ln for ln in lines), lines
    # no GEOTRAIN_SECRET_FILE: the secret went through the c10d store, and rank 0 said so, once
    assert r.stderr.count("the run secret is shared through the rendezvous store") == 1, r.stderr[-2000:]


def test_auto_under_torchrun_trains_like_the_built_in_launcher(runs):
    tmp, _ = runs
    auto, off = _losses(tmp / "auto"), _losses(tmp / "off")
    assert len(auto) == 3 and auto == off


def test_serve_prefill_under_torchrun_is_refused_in_one_line(tmp_path):
    r = _torchrun("--steps", "1", "--serve-prefill", "0", "--out", str(tmp_path / "x"), timeout=120)
    assert r.returncode != 0
    assert "--serve-prefill is not available under torchrun" in r.stderr
