"""A live two-DC training run (2 ranks, pp=2 across east/west) under attack: forged hellos
claiming rank 0, garbage, oversize headers and handshakes with a wrong proof hit the ranks'
striped-transport listeners all through the run (user-space WAN on loopback), and (as root)
`ss -K` resets the cross-DC connections mid-run -- on loopback, and inside each DC's network
namespace of the kernel-emulated WAN. Training must finish with losses identical to an
undisturbed run, each attack logged and dropped."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from geotrain.config.load import load_spec
from geotrain.plan.manual import plan_from_job
from geotrain.plan.plan import LinkPlan
from geotrain.runtime.launch import launch, run_with_wan
from geotrain.runtime.trainer import RunConfig

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
STEPS = 12
OLD_HELLO = struct.Struct("!IiH")
OLD_HEADER = struct.Struct("!IqQHHQQQI")
OLD_MAGIC = 0x47545350
NEW_HELLO = struct.Struct("!IBiiH16s")


def _plan():
    base = plan_from_job(load_spec(SPEC)).with_(precision="fp32", sharding="replicate", schedule="1f1b")
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=4) for lp in base.links)
    return base.with_(dp=1, links=links, pipeline_offsets=())


def _cfg(out: Path, plan) -> RunConfig:
    return RunConfig(spec=str(SPEC), out=str(out), plan=plan.to_dict(), steps=STEPS, data="synthetic",
                     progress=False, checkpoint_every=0)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "losses.jsonl").read_text().splitlines() if x.strip()]


def _logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log")))


ATTACKS = [
    OLD_HELLO.pack(OLD_MAGIC, 0, 0),                                                     # forged hello
    os.urandom(2048),                                                                    # garbage
    OLD_HELLO.pack(OLD_MAGIC, 0, 0) + OLD_HEADER.pack(OLD_MAGIC, 0, 0, 0, 1, 2**62, 0, 2**62, 0),  # oversize
    NEW_HELLO.pack(0x47544155, 1, 0, 1, 0, os.urandom(16)) + os.urandom(64),             # a guessed proof
]


def _attacker(run_dir: Path, stop: threading.Event, hits: list, reset: bool) -> None:
    """Finds the striped listeners in the rank logs, then attacks them until the run ends."""
    ports: set[int] = set()
    while not stop.is_set():
        if (run_dir / "logs").exists():
            ports |= {int(p) for p in re.findall(r"listening on 127\.0\.0\.1:(\d+)", _logs(run_dir))}
        for port in sorted(ports):
            for payload in ATTACKS:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                        s.sendall(payload)
                    hits.append(port)
                except OSError:
                    pass
            if reset:           # reset every established connection to or from this listener
                r = subprocess.run(["ss", "-K", "state", "established", f"( sport = :{port} or dport = :{port} )"],
                                   capture_output=True, text=True)
                hits.append(("reset", port, max(0, len(r.stdout.splitlines()) - 1)))
        stop.wait(0.15)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    launch([_cfg(tmp, _plan())], 2, tmp)
    return _losses(tmp)


def _attacked_run(tmp_path: Path, reset: bool):
    stop, hits = threading.Event(), []
    t = threading.Thread(target=_attacker, args=(tmp_path, stop, hits, reset), daemon=True)
    t.start()
    try:
        run_with_wan([_cfg(tmp_path, _plan())], load_spec(SPEC), _plan(), tmp_path, mode="shaper",
                     say=lambda _line: None, timeout_s=240)
    finally:
        stop.set()
        t.join()
    return hits


@pytest.mark.slow
def test_forged_garbage_and_oversize_connections_leave_the_losses_identical(reference, tmp_path):
    hits = _attacked_run(tmp_path, reset=False)
    assert len(hits) >= 8, hits                              # the attacks reached both ranks' listeners
    assert _losses(tmp_path) == reference and len(reference) == STEPS
    logs = _logs(tmp_path)
    assert "striped listener: dropped a connection" in logs
    assert "Traceback" not in logs


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None, reason="ss -K needs root")
def test_connections_reset_mid_run_are_reestablished_and_the_losses_identical(reference, tmp_path):
    hits = _attacked_run(tmp_path, reset=True)
    killed = sum(h[2] for h in hits if isinstance(h, tuple))
    logs = _logs(tmp_path)
    assert killed > 0, hits
    assert _losses(tmp_path) == reference
    assert "Traceback" not in logs


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ss") is None, reason="network namespaces need root")
def test_ss_kill_inside_the_dc_namespaces_leaves_the_losses_identical(reference, tmp_path):
    from geotrain.emulation import emulation_available

    ok, why = emulation_available()
    if not ok:
        pytest.skip(why)
    stop, kills, wans = threading.Event(), [], []

    def killer() -> None:
        while not stop.is_set() and not wans:
            stop.wait(0.05)
        emu = wans[0].emulation if wans else None
        while emu is not None and not stop.is_set():
            if (tmp_path / "logs").exists():
                for port in set(re.findall(r"listening on [\d.]+:(\d+)", _logs(tmp_path))):
                    for dc in emu.dcs:
                        r = subprocess.run(["ip", "netns", "exec", emu.netns(dc), "ss", "-K", "state", "established",
                                            f"( sport = :{port} or dport = :{port} )"], capture_output=True, text=True)
                        kills.append(max(0, len(r.stdout.splitlines()) - 1))
            stop.wait(1.0)          # a reconnect (4 connections, 3 round trips each over 40 ms) must fit between

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        run_with_wan([_cfg(tmp_path, _plan())], load_spec(SPEC), _plan(), tmp_path, mode="kernel",
                     say=lambda _line: None, timeout_s=240, on_wan=wans.append)
    finally:
        stop.set()
        t.join()
    assert sum(kills) > 0, kills
    assert _losses(tmp_path) == reference
    assert "Traceback" not in _logs(tmp_path)
