"""DiLoCo's outer loop in one process: the streaming schedule, the outer Nesterov step, and the
exchange between workers (runtime.outer_group) -- members in threads over a real TCPStore and
striped transports, one of them going silent."""

from __future__ import annotations

import functools
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan, StagePlan
from geotrain.layout.workers import OuterPlan, describe_outer, outer_problem
from geotrain.orchestrate.elastic import WorkerCuts, parse_cut
from geotrain.runtime.diloco import DiLoCo, fragments_of
from geotrain.runtime.outer_group import OuterGroup, WorkerDropped
from geotrain.transport.auth import new_secret
from geotrain.transport.striped import StripedTransport


def _params(sizes=(7, 3, 12, 5, 9, 4)):
    g = torch.Generator().manual_seed(0)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(n, generator=g))) for i, n in enumerate(sizes)]


class _Recording:
    """A one-worker 'group' that records what each exchange averages (and averages nothing)."""

    def __init__(self):
        self.vectors: list[torch.Tensor] = []
        self.exchanges = self.sent_bytes = 0
        self.admitted: list = []

    def average(self, v, codec):
        self.vectors.append(v.clone())
        self.exchanges += 1
        return v

    def close(self):
        pass


@pytest.mark.parametrize("h,f", [(4, 1), (8, 4), (6, 3), (4, 4)])
def test_streaming_fragments_are_each_synced_exactly_once_per_period(h, f):
    named = _params()
    group = _Recording()
    o = OuterPlan(workers=(("a",), ("b",)), inner_steps=h, fragments=f, lr=1.0, momentum=0.0)
    dl = DiLoCo(o, named, group)
    periods = 3
    for step in range(1, periods * h + 1):
        with torch.no_grad():
            for _, p in named:
                p.add_(0.01)             # an inner step moved every parameter
        dl.after_step(step)
    # per period, every fragment once, at its own staggered step (f+1) H/F
    for k in range(periods):
        steps = [(s, fr) for s, fr in dl.syncs if k * h < s <= (k + 1) * h]
        assert sorted(fr for _, fr in steps) == list(range(f))
        assert all(s == k * h + (fr + 1) * h // f for s, fr in steps)
    # the fragments partition the parameters: every element exchanged once per period
    per_period = sum(v.numel() for v in group.vectors[:f])
    assert per_period == sum(p.numel() for _, p in named)
    assert fragments_of([p.numel() for _, p in named], f) == dl.frags and all(dl.frags)


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient():
    named = _params((5,))
    p = named[0][1]
    start = p.detach().clone()
    o = OuterPlan(workers=(("a",),), inner_steps=2, lr=0.7, momentum=0.9)
    dl = DiLoCo(o, named, None)
    m = torch.zeros(5)
    anchor = start.clone()
    for step in range(1, 7):
        with torch.no_grad():
            p.sub_(0.1 * step)
        dl.after_step(step)
        if step % 2 == 0:
            delta = anchor - (anchor - 0.1 * (step - 1) - 0.1 * step)
            m = 0.9 * m + delta
            anchor = anchor - 0.7 * (delta + 0.9 * m)
            assert torch.allclose(p.detach(), anchor, atol=1e-6)


def test_plan_refuses_impossible_outer_settings():
    o = OuterPlan(workers=(("a",), ("b",)), inner_steps=8, fragments=3)
    assert outer_problem(o, 1)[0] == "fragments"
    assert outer_problem(OuterPlan(workers=(("a", "b"),)), 1)[0] == "workers[0]"
    assert outer_problem(OuterPlan(workers=(("a",),), inner_steps=8, fragments=2, overlap=4), 1)[0] == "overlap"
    assert outer_problem(OuterPlan(workers=(("a",),), compression="int3"), 1)[0] == "compression"
    plan = Plan(stages=(StagePlan("a", ((0, 4),)),), dp=2, micro_batch=1, num_microbatches=2,
                outer=OuterPlan(workers=(("a",), ("b",), ("c",))))
    assert plan.global_batch == 3 * 2 * 2
    assert plan.worker_plan(2).stages[0].dc == "c" and plan.worker_plan(2).num_ranks == 2
    assert plan.gpus_per_dc() == {"a": 2, "b": 2, "c": 2}
    assert Plan.from_dict(plan.to_dict()) == plan


# ------------------------------------------------------------------------- the exchange protocol
def _group(store_port: int, secret: bytes, w: int, workers: int, dead_after_s: float, inner_rank: int = 0,
           inner_ranks: int = 1, incarnation: int = 0) -> OuterGroup:
    def client():
        return TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=30))

    store = client()

    def transport(ident):
        return StripedTransport(ident, store, secret=secret, connections=2, prefix="t/striped", min_chunk_bytes=256,
                                timeout_s=60, max_message_bytes=1 << 20)

    return OuterGroup(store, client(), transport, worker=w, workers=workers, inner_rank=inner_rank,
                      inner_ranks=inner_ranks, dead_after_s=dead_after_s, incarnation=incarnation)


def _master() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


def _in_threads(calls: dict, limit_s: float = 20) -> tuple[dict, dict]:
    """Run {name: fn} in threads; their results and exceptions by name (a thread still running fails)."""
    results, errors = {}, {}

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as e:  # noqa: BLE001 -- returned to the test
            errors[name] = e

    threads = {n: threading.Thread(target=run, args=(n, fn), daemon=True) for n, fn in calls.items()}
    for t in threads.values():
        t.start()
    for n, t in threads.items():
        t.join(limit_s)
        assert not t.is_alive(), f"{n} still waiting after {limit_s} s"
    return results, errors


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_members_hold_the_same_average_and_go_on_without_a_silent_one(codec):
    master = _master()
    secret = new_secret()
    groups = [_group(master.port, secret, w, 3, dead_after_s=1.0) for w in range(3)]
    vecs = [torch.randn(1000, generator=torch.Generator().manual_seed(w)) for w in range(3)]
    results: dict[tuple[int, int], torch.Tensor] = {}
    errors: dict[int, BaseException] = {}

    def member(w: int, rounds: int):
        try:
            for r in range(rounds):
                results[(w, r)] = groups[w].average(vecs[w] * (r + 1), codec)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors[w] = e

    # worker 2 takes part in round 0 only, then stops beating (a lost worker)
    threads = [threading.Thread(target=member, args=(w, 3 if w < 2 else 1)) for w in range(3)]
    for t in threads:
        t.start()
    threads[2].join(30)
    groups[2]._closed.set()                # its heartbeat stops: it is gone
    for t in threads[:2]:
        t.join(60)
    assert not errors, errors
    mean = sum(vecs) / 3
    for w in range(3):                     # round 0: all three, identical everywhere
        assert torch.equal(results[(w, 0)], results[(0, 0)])
    tol = 0 if codec == "fp32" else 2 * mean.abs().max() / 120
    assert (results[(0, 0)] - mean).abs().max() <= tol + 1e-6
    for r in (1, 2):                       # then the two survivors, still identical
        assert torch.equal(results[(0, r)], results[(1, r)])
        pair = (vecs[0] + vecs[1]) * (r + 1) / 2
        assert (results[(0, r)] - pair).abs().max() <= (r + 1) * tol + 1e-5
    assert groups[0].members == [(0, 0), (1, 0)]
    with pytest.raises(WorkerDropped):     # the silent one, back for round 1, finds it went on without it
        groups[2].average(vecs[2], codec)
    for g in groups:
        g.close()


# ------------------------------------------------------------- no wait on the store outlives a lost peer
def test_survivors_go_on_when_the_aborter_died_before_naming_them():
    """Worker 2 aborted exchange #0 and died before it wrote who retries: the others find it dead
    and name the survivors themselves (the store client's 30 s timeout used to raise instead)."""
    master, secret = _master(), new_secret()
    groups = [_group(master.port, secret, w, 3, dead_after_s=0.5) for w in range(3)]
    groups[2]._closed.set()                                  # no more heartbeats: it is gone
    master.set("geotrain/outer/r0/fin/0/0", "abort")          # its abort, and nothing after it
    vecs = [torch.full((64,), float(w)) for w in range(2)]
    t0 = time.monotonic()
    results, errors = _in_threads({w: functools.partial(groups[w].average, vecs[w], "fp32") for w in range(2)})
    assert not errors, errors
    assert time.monotonic() - t0 < 10
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], torch.full((64,), 0.5))
    assert groups[0].members == [(0, 0), (1, 0)]
    for g in groups:
        g.close()


def test_ranks_whose_ranks_0_are_lost_stop_in_one_line_instead_of_waiting():
    """Rank 1 of each worker learns whom an exchange admits from a rank 0; every rank 0 is gone:
    the ranks 1 say so once those heartbeats stood still (a store get used to wait out its timeout)."""
    master, secret = _master(), new_secret()
    zeros = [_group(master.port, secret, w, 2, dead_after_s=0.5, inner_ranks=2) for w in range(2)]
    for g in zeros:
        g._closed.set()
    ones = [_group(master.port, secret, w, 2, dead_after_s=0.5, inner_rank=1, inner_ranks=2) for w in range(2)]
    results, errors = _in_threads({w: functools.partial(ones[w].average, torch.ones(32), "fp32") for w in range(2)})
    assert not results and sorted(errors) == [0, 1]
    for e in errors.values():
        assert isinstance(e, GeotrainError) and "rank 0 stopped" in str(e) and "\n" not in str(e)
    for g in (*zeros, *ones):
        g.close()


def test_a_restarted_worker_with_no_one_left_to_admit_it_stops_in_one_line():
    master, secret = _master(), new_secret()
    other = _group(master.port, secret, 1, 2, dead_after_s=0.5)
    other._closed.set()                                      # the only other worker: gone, never finished
    joiner = _group(master.port, secret, 0, 2, dead_after_s=0.5, incarnation=1)
    _, errors = _in_threads({"join": joiner.welcomed})
    assert "no other worker is alive to admit it" in str(errors["join"])
    for g in (other, joiner):
        g.close()


def test_a_cut_of_a_diloco_plan_names_any_workers_dc_and_only_kills():
    plan = Plan(stages=(StagePlan("a", ((0, 4),)),), dp=1, micro_batch=1, num_microbatches=2,
                outer=OuterPlan(workers=(("a",), ("b",))))
    cuts = WorkerCuts(parse_cut("b:3", plan), plan, Path("run"))    # worker 1's DC
    assert [w.ranks for w in cuts.watchers.values()] == [[], [0]]
    assert cuts.watchers[1].losses == Path("run/worker1/losses.jsonl")
    with pytest.raises(GeotrainError, match="holds no stage"):
        parse_cut("z:3", plan)
    with pytest.raises(GeotrainError, match="--cut-link is not rehearsed for a DiLoCo plan"):
        WorkerCuts(parse_cut("b:3", plan, "link"), plan, Path("run"))


def test_the_mode_in_one_line_says_how_often_what_is_exchanged():
    o = OuterPlan(workers=(("a", "b"), ("c", "d")), inner_steps=16, fragments=4, overlap=1, compression="int8")
    line = describe_outer(o)
    assert "2 workers (a+b | c+d): H=16 (one of 4 fragments every 4 steps, overlapping 1 inner step(s))" in line
    assert line.endswith("outer gradients int8, outer Nesterov SGD lr 0.7 momentum 0.9")
    sync = describe_outer(OuterPlan(workers=(("a",), ("b",)), inner_steps=1, lr=1.0, momentum=0.0))
    assert "H=1 (an exchange every 1 steps)" in sync and sync.endswith("outer SGD lr 1")
