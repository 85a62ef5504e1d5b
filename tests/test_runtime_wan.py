"""Training over the emulated WAN (runtime.cross_dc): the same losses as without it, with striped
multi-connection transfers and with temporal link sharing; nothing left behind; no hangs.

The WAN runs are kernel emulation (network namespaces) when root -- CI runs as root -- else the
user-space shaper. The reference without the WAN is a case of test_runtime_pipeline's launch
(conftest's `pipeline_launch`: no launch of its own); one launch over the WAN runs
1-connection fair, 4-connection fair and 4-connection temporal (with staggered pipeline starts)
back to back, so process start-up is paid once. fp32, tiny model, pp=2 x dp=2, 3 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _cases import case

from geotrain.costs import CostModel
from geotrain.errors import GeotrainError
from geotrain.layout.plan import LinkPlan
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.cross_dc import leftover_namespaces, sends_per_boundary, start_delay, turn_order
from geotrain.runtime.launch import run_with_wan
from geotrain.runtime.p2p import RoutedTransport
from geotrain.runtime.train_config import RunCase, TestHooks, TrainConfig, WanConfig
from geotrain.schedule.actions import Op
from geotrain.schedule.builders import build_schedule
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
STEPS = 3
MODE = "kernel" if os.geteuid() == 0 else "shaper"


def _plan(connections: int = 1, sharing: str = "fair", offsets=()):
    base = plan_from_job(load_spec(SPEC)).with_(precision="fp32", sharding="replicate", schedule="1f1b")
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc, connections=connections, sharing=sharing,
                           order=(1, 0) if sharing == "temporal" else ()) for lp in base.links)
    return base.with_(links=links, pipeline_offsets=tuple(offsets))


def _cfg(out: Path, plan, trace: bool = False, mode: str = "off") -> RunCase:
    return case(SPEC, out=str(out), plan=plan, steps=STEPS, data="synthetic", progress=False, checkpoint_every=0,
                trace=trace, wan=WanConfig(mode=mode))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "losses.jsonl").read_text().splitlines() if x.strip()]


def _rank_logs(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("rank*.log")))


# ---------------------------------------------------------------------------------------- unit
class _Recording:
    def __init__(self, name):
        self.name, self.calls, self.closed = name, [], 0

    def send(self, tensor, dst, tag):
        self.calls.append(("send", dst, tag))
        return self.name

    def recv(self, tensor, src, tag):
        self.calls.append(("recv", src, tag))
        return self.name

    def close(self):
        self.closed += 1


def test_routed_transport_sends_each_peer_through_its_own_transport():
    gloo, wan = _Recording("gloo"), _Recording("wan")
    rt = RoutedTransport(gloo, {2: wan, 3: wan})
    assert rt.send(None, 1, 7) == "gloo" and rt.send(None, 2, 7) == "wan" and rt.recv(None, 3, 5) == "wan"
    assert gloo.calls == [("send", 1, 7)] and wan.calls == [("send", 2, 7), ("recv", 3, 5)]
    rt.close()
    assert wan.closed == 1 and gloo.closed == 1          # a transport shared by two peers closes once


@pytest.mark.parametrize("kind,kw", [("1f1b", {}), ("gpipe", {}), ("zb-h1", {}),
                                     ("wan-1f1b", {"extra_warmup": [2, 1, 0]}),
                                     ("interleaved", {"virtual_per_stage": 2})])
def test_turn_taking_is_matched_by_the_schedule(kind, kw):
    """What keeps temporal turns deadlock-free: per boundary, the receiver expects exactly the sender's
    messages in the sender's order, and a stage posts all its sends before its optimizer step (the
    world-wide all-reduce), so every turn of an iteration is taken within it."""
    pp, m = 3, 6
    sched = build_schedule(kind, pp, m, **kw)
    plan = _plan().with_(stages=tuple(_plan().stages[0:1]) * pp)     # only pp matters here
    sends = sends_per_boundary(plan, sched)
    assert sends
    for (s, r), seq in sends.items():
        recvs = [("send_act" if a.op == Op.RECV_ACT else "send_grad", a.peer, a.mb) for a in sched.actions[r]
                 if a.op in (Op.RECV_ACT, Op.RECV_GRAD) and a.peer % pp == s]
        assert recvs == seq, (s, r)
    for s, actions in enumerate(sched.actions):
        ops = [a.op for a in actions]
        last_send = max((i for i, o in enumerate(ops) if o in (Op.SEND_ACT, Op.SEND_GRAD)), default=-1)
        assert last_send < ops.index(Op.OPTIMIZER), s


def test_a_peer_that_dies_fails_pending_receives_at_once_not_at_the_timeout():
    """What keeps a rank from hanging on a dead peer under torchrun (no launcher to stop it)."""
    import time

    import torch
    import torch.distributed as dist

    from geotrain.transport.striped import StripedTransport, TransportError

    store = dist.HashStore()
    a = StripedTransport(0, store, connections=2, min_chunk_bytes=256, timeout_s=60)
    b = StripedTransport(1, store, connections=2, min_chunk_bytes=256, timeout_s=60)
    try:
        x = torch.arange(1000, dtype=torch.float32)
        y, z, late = torch.empty(1000), torch.empty(1000), torch.empty(1000)
        a.send(x, 1, tag=1).wait()
        assert b.recv(y, 0, tag=1).wait() and torch.equal(x, y)      # a message that arrived is kept
        pending = b.recv(z, 0, tag=1)
        a.close()                                                      # the peer dies
        t = time.monotonic()
        with pytest.raises(TransportError, match="rank 0 closed its transport"):
            pending.wait()
        with pytest.raises(TransportError, match="rank 0 closed its transport"):
            b.recv(late, 0, tag=2).wait()
        assert time.monotonic() - t < 10
    finally:
        a.close()
        b.close()


def test_plan_offsets_and_turn_order():
    plan = _plan(sharing="temporal", offsets=(0.0, 0.25))
    assert start_delay(plan, 0) == 0.0 and start_delay(plan, 1) == 0.25 and start_delay(_plan(), 1) == 0.0
    assert turn_order(plan.links[0], 2) == [1, 0]
    with pytest.raises(GeotrainError, match="exactly once"):
        turn_order(LinkPlan("east", "west", sharing="temporal", order=(0, 0)), 2)


# ---------------------------------------------------------------------------------------- real runs
def reference_case(out: Path) -> RunCase:
    """The WAN cases' layout over plain gloo: conftest's `pipeline_launch` runs it (4 ranks)."""
    return _cfg(out, _plan())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wan")
    cases = {"c1-fair": _plan(1), "c4-fair": _plan(4), "c4-temporal": _plan(4, "temporal", offsets=(0.0, 0.2))}
    said = []
    wan = run_with_wan([_cfg(tmp / n, p, trace=n == "c4-fair", mode=MODE) for n, p in cases.items()], tmp / "wan",
                       say=said.append)
    return tmp, wan, said


@pytest.mark.slow
def test_losses_over_the_emulated_wan_equal_the_local_run(runs, pipeline_launch):
    tmp, wan, said = runs
    assert wan.mode == MODE and said and said[0].startswith(f"WAN: {'kernel' if MODE == 'kernel' else 'user-space'}")
    ref = _losses(pipeline_launch / "wan-ref")
    assert len(ref) == STEPS
    for name in ("c1-fair", "c4-fair", "c4-temporal"):
        assert _losses(tmp / name) == ref, name


@pytest.mark.slow
def test_cross_dc_pairs_use_the_plans_connections_and_sharing(runs):
    tmp, _, _ = runs
    logs = _rank_logs(tmp / "wan")
    # Each of the 4 ranks has one cross-DC peer stage; the 3 cases build 3 transports per rank.
    assert logs.count("StripedTransport, 1 connections, fair") == 4
    assert logs.count("StripedTransport, 4 connections, fair") == 4
    assert logs.count("StripedTransport, 4 connections, temporal, turn order [1, 0]") == 4


@pytest.mark.slow
def test_cross_dc_sends_are_recorded_as_transfers_on_their_wan_link(runs):
    from geotrain.trace.schema import Trace

    tmp, _, _ = runs
    trace = Trace.read_jsonl(tmp / "c4-fair" / "measured_trace.jsonl")
    xfers = [e for e in trace.events if e.kind == "transfer"]
    spec = load_spec(SPEC)
    plan = _plan()
    boundary = CostModel(spec.model, precision=plan.precision).boundary_bytes(plan.micro_batch)   # as simulated
    assert {e.link for e in xfers} == {"east->west", "west->east"}
    # every micro-batch's activation and gradient of every pipeline, every step
    assert len(xfers) == 2 * plan.num_microbatches * plan.dp * STEPS
    assert all(e.bytes == boundary and e.end >= e.start for e in xfers)
    assert any(e.end > e.start for e in xfers)   # the striped transport says when its last byte left


@pytest.mark.slow
def test_nothing_is_left_behind(runs):
    _, wan, _ = runs
    assert wan.emulation is None
    if MODE == "kernel":
        assert wan.tag and leftover_namespaces(wan.tag) == []
    workers = subprocess.run(["pgrep", "-f", "geotrain.runtime.worker .*/wan/logs/"], capture_output=True, text=True)
    assert workers.stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.skipif(MODE == "shaper", reason="the WAN runs above already use the shaper")
def test_the_user_space_shaper_fallback_trains_the_same(runs, pipeline_launch, tmp_path):
    """--wan shaper (what non-root machines get): delay and rates inside the transport, same losses."""
    tmp, _, _ = runs
    said = []
    wan = run_with_wan([_cfg(tmp_path / "shaped", _plan(2, "temporal", offsets=(0.0, 0.1)), mode="shaper")], tmp_path,
                       say=said.append)
    assert wan.mode == "shaper" and said[0].startswith("WAN: user-space shaper")
    assert "StripedTransport, 2 connections, temporal, turn order [1, 0], shaper" in _rank_logs(tmp_path)
    assert _losses(tmp_path / "shaped") == _losses(pipeline_launch / "wan-ref")


@pytest.mark.slow
def test_a_failing_rank_ends_the_run_with_one_line_and_tears_the_wan_down(tmp_path, capfd):
    """`geotrain train --wan MODE`: rank 3 dies in step 2 while temporal turns are in use; the run
    fails at once naming it (exit 2, no traceback) and the emulation is gone afterwards."""
    from geotrain.orchestrate.training_run import train

    said = []
    config = TrainConfig(out=str(tmp_path / "run"), steps=3, wan=WanConfig(mode=MODE), progress=False,
                         data="synthetic", hooks=TestHooks(fail_at=[(3, 2)]))
    with pytest.raises(GeotrainError) as e:
        train(load_spec(SPEC), config, plan=_plan(2, "temporal"), say=said.append)
    assert "rank 3 (stage 1, replica 1, west) failed" in str(e.value) and "\n" not in str(e.value)
    assert "injected failure at step 2" in str(e.value)
    out = "\n".join(said)
    assert "WAN: " in out
    if MODE == "kernel":
        tag = out.split("gt-", 1)[1].split("-*", 1)[0]
        assert leftover_namespaces(tag) == []


def test_cli_refuses_an_unknown_wan_mode():
    r = subprocess.run([sys.executable, "-m", "geotrain", "train", str(SPEC), "--wan", "bogus"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--wan" in r.stderr
