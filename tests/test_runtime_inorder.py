"""The pipeline interpreter over a transport with NCCL's in-order semantics, for every schedule kind.

Ranks of a pp=2 pipeline run as threads over `_inorder_transport.InOrderHub` (tags ignored,
rendezvous sends, operations of a stream in posting order). With one stream per direction -- what
`TorchTransport`'s per-direction process groups give -- every schedule completes with the losses
of a tag-matching run; with one shared stream per rank (what one process group for all transfers
gave before), the interpreter's look-ahead receives deadlock, exactly where `check_in_order`
predicts. `directed_groups` itself is checked on a real gloo group.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

import pytest
import torch
from _inorder_transport import Deadlock, InOrderHub

from geotrain.models.llama import build_units
from geotrain.planner.manual import plan_from_job
from geotrain.runtime.batches import SyntheticTokens
from geotrain.runtime.interpreter import PipelineRank
from geotrain.runtime.recorder import Recorder
from geotrain.schedule import ScheduleError, check_schedule
from geotrain.schedule.builders import schedule_for_plan
from geotrain.schedule.inorder import check_in_order
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc_pp2.toml"
KINDS = [("gpipe", 1, {}), ("1f1b", 1, {}), ("interleaved", 2, {}), ("zb-h1", 1, {}),
         ("wan-1f1b", 1, {"extra_warmup": (1, 0)})]


def _plan(kind: str, vps: int, extra: dict):
    return plan_from_job(load_spec(SPEC), virtual_per_stage=vps).with_(precision="fp32", schedule=kind, **extra)


@functools.cache
def _reference() -> tuple[float, ...]:
    return tuple(_run("gpipe", 1, {}, "directed")[0])


def _run(kind: str, vps: int, extra: dict, streams: str, steps: int = 2, timeout_s: float = 20.0):
    """Train `steps` iterations of a pp=2 x dp=1 plan in threads; per-step losses of the last stage."""
    spec = load_spec(SPEC)
    plan = _plan(kind, vps, extra)
    schedule = schedule_for_plan(plan)
    hub = InOrderHub(streams, timeout_s=timeout_s)
    src = SyntheticTokens(spec.model.vocab, spec.model.seq_len, plan.micro_batch, plan.num_microbatches, 1,
                          spec.job.seed)
    losses: dict[int, list[float]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank_main(stage: int) -> None:
        try:
            torch.manual_seed(spec.job.seed)
            chunks = {c * plan.pp + stage: build_units(spec.model, a, b)
                      for c, (a, b) in enumerate(plan.stages[stage].chunks)}
            params = [p for m in chunks.values() for p in m.parameters()]
            opt = torch.optim.AdamW(params, lr=spec.job.lr)

            runner = PipelineRank(plan=plan, schedule=schedule, stage=stage, replica=0, chunks=chunks,
                                  transport=hub.transport(plan.rank(stage, 0)), recorder=Recorder(stage, 0.0),
                                  autocast=contextlib.nullcontext,
                                  boundary_shape=(plan.micro_batch, spec.model.seq_len, spec.model.hidden))
            for step in range(steps):
                batches = {j: src.batch(step, 0, j) for j in range(plan.num_microbatches)}
                losses[stage].append(runner.run_iteration(batches))   # returns at the OPTIMIZER action
                opt.step()
                opt.zero_grad(set_to_none=True)
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(s,), daemon=True) for s in range(plan.pp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    if errors:
        raise errors[0]
    return losses[1], schedule


@pytest.mark.parametrize("kind,vps,extra", KINDS, ids=[k[0] for k in KINDS])
def test_every_schedule_completes_on_directed_in_order_streams(kind, vps, extra):
    got, schedule = _run(kind, vps, extra, "directed")
    check_schedule(schedule)                      # the model agrees: directed streams, runtime look-ahead
    ref = _reference()                           # same math, another order: equal losses
    assert len(got) == 2 and got[1] < got[0] + 1.0
    for g, r in zip(got, ref):
        assert abs(g - r) <= 1e-5 * abs(r), (kind, got, ref)


@pytest.mark.parametrize("kind,vps,extra", KINDS, ids=[k[0] for k in KINDS])
def test_shared_stream_deadlocks_where_the_model_says(kind, vps, extra):
    """One stream per rank (one communicator for all transfers, as before): the look-ahead deadlocks."""
    schedule = schedule_for_plan(_plan(kind, vps, extra))
    with pytest.raises(ScheduleError, match="deadlocks on an in-order transport"):
        check_in_order(schedule, lookahead=2, streams="shared")
    with pytest.raises(Deadlock):
        _run(kind, vps, extra, "shared", steps=1, timeout_s=1.5)


@pytest.mark.parametrize("kind,vps,pp,dp", [("1f1b", 1, 2, 2), ("interleaved", 2, 2, 1), ("interleaved", 2, 4, 2),
                                            ("zb-h1", 1, 4, 1)])
def test_each_direction_has_a_group_where_every_rank_has_one_peer(kind, vps, pp, dp):
    from geotrain.runtime.p2p import direction_pairs, stage_directions
    from geotrain.schedule import build_schedule

    schedule = build_schedule(kind, pp, 2 * pp, **({"virtual_per_stage": vps} if vps > 1 else {}))
    base = _plan("1f1b", 1, {})
    plan = base.with_(stages=tuple(base.stages[0] for _ in range(pp)), dp=dp)   # only the rank layout matters
    dirs = stage_directions(schedule)
    want = {(s, s + 1) for s in range(pp - 1)} | {(s + 1, s) for s in range(pp - 1)}
    if vps > 1:
        want |= {(pp - 1, 0), (0, pp - 1)}
    assert set(dirs) == want
    groups = direction_pairs(plan, schedule)
    assert len(groups) == len(dirs)
    for (a, b), (members, pairs) in zip(dirs, groups):
        assert len(pairs) == dp * plan.tp
        ends = [r for pair in pairs for r in pair]
        assert sorted(ends) == members and len(set(ends)) == len(ends)   # one peer, one direction each
        assert all(plan.coords(s)[0] == a and plan.coords(d)[0] == b for s, d in pairs)
