"""A stage's DP sync is priced on the collectives the runtime's FSDP2 really runs -- the ones the
WAN byte count counts (costs.comm.sync_collectives): under zero3 the reduce-scatter and m+1
parameter gathers (reshard_after_forward re-gathers after every forward), in the parameters'
gather dtype, in the simulator's sync, the planner's estimate and layout.wan_bytes alike."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from geotrain.costs import CostModel, comm
from geotrain.costs.comm import GBIT, hierarchical_half
from geotrain.layout.plan import Plan, StagePlan
from geotrain.layout.stage_costs import StageCosts
from geotrain.planner.context import PlanningContext
from geotrain.planner.manual import plan_from_job
from geotrain.planner.plan_score import plan_stage_costs
from geotrain.schedule.actions import Op
from geotrain.schedule.builders import schedule_for_plan
from geotrain.sim import simulate
from geotrain.spec.load import load_spec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_2dc.toml"


def _sync_events(res, plan):
    """The simulated sync's duration per physical stage (its first replica's rank)."""
    out = []
    for s in range(plan.pp):
        r = plan.rank(s, 0)
        out.append(next(e.duration for e in res.trace.events if e.rank == r and e.kind == "allreduce"))
    return out


def _halves(cost, st, sharding, m):
    """By hand: the bytes per GPU of each collective one stage's DP group runs per iteration."""
    g, p = cost.grad_bytes(st.units), cost.stage_params(st.units) * (2 if cost.precision == "bf16" else 4)
    if sharding == "replicate":
        return [g, g]
    return [g] + [p] * (1 if sharding == "zero2" else m + 1)


@pytest.mark.parametrize("sharding,precision", [("zero3", "bf16"), ("zero3", "fp32"), ("zero2", "fp16"),
                                                ("replicate", "bf16")])
def test_the_sync_inside_a_dc_counts_every_gather_fsdp2_runs(sharding, precision):
    spec = load_spec(SPEC)
    spec = replace(spec, job=spec.job.model_copy(update={"precision": precision, "sharding": sharding}))
    plan = plan_from_job(spec).with_(sharding=sharding, precision=precision)
    assert plan.dp == 2 and plan.num_microbatches == 4 and not plan.replica_dcs
    cost = CostModel(spec.model, precision=precision)
    tied = StageCosts(cost, spec.cluster).plan_tied_sum(plan)
    want = []
    for s, st in enumerate(plan.stages):
        dc = spec.cluster.dc(st.dc)
        t = sum(hierarchical_half(b, plan.dp, dc.gpus_per_node, dc) for b in _halves(cost, st, sharding, 4))
        want.append(t + (tied if s in (0, plan.pp - 1) else 0.0))
    assert _sync_events(simulate(spec, plan), plan) == pytest.approx(want)
    assert [c.allreduce for c in plan_stage_costs(PlanningContext(spec), plan)] == pytest.approx(want)


def test_a_region_plans_sync_counts_every_gather_across_the_wan():
    spec = load_spec(SPEC)
    base = plan_from_job(spec)
    plan = base.with_(stages=tuple(StagePlan(dc="east", chunks=st.chunks) for st in base.stages),
                      replica_dcs=("east", "west"), links=(), name="tiny-region", sharding="zero3")
    cost = CostModel(spec.model, precision=plan.precision)
    link = spec.cluster.link("east", "west")
    rate, lat = link.rate_gbps(1) * GBIT, link.latency_ms * 1e-3   # one replica (tp 1) per DC owns a shard
    tied = StageCosts(cost, spec.cluster).plan_tied_sum(plan)
    want = [sum(b / 2 / rate + lat for b in _halves(cost, st, "zero3", plan.num_microbatches)) + tied
            for st in plan.stages]
    assert len(_halves(cost, plan.stages[0], "zero3", 4)) == 6   # 1 reduce-scatter + 5 gathers
    assert _sync_events(simulate(spec, plan), plan) == pytest.approx(want)
    assert [c.allreduce for c in plan_stage_costs(PlanningContext(spec), plan)] == pytest.approx(want)


def _gathers_read_off(plan, v: int) -> int:
    """Gathers of chunk v in the plan's schedule: an op gathers when the chunk is sharded, and only
    a forward reshards it (zero3's reshard_after_forward; backwards keep the weights)."""
    gathered, count = False, 0
    for act in schedule_for_plan(plan).actions[v % plan.pp]:
        if act.stage != v or not act.op.is_compute or act.op in (Op.OPTIMIZER, Op.PREFILL):
            continue
        count += not gathered
        gathered = act.op != Op.FORWARD
    return count


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1", "wan-1f1b", "interleaved"])
def test_zero3s_gather_count_is_read_off_every_schedule_kind(kind):
    spec = load_spec(SPEC)
    plan = plan_from_job(spec).with_(sharding="zero3", schedule=kind)
    if kind == "wan-1f1b":
        plan = plan.with_(extra_warmup=(1, 0))
    if kind == "interleaved":
        n = spec.model.num_units
        cuts = [0, n // 4, n // 2, 3 * n // 4, n]
        r = [(cuts[i], cuts[i + 1]) for i in range(4)]
        plan = plan.with_(stages=tuple(StagePlan(dc=st.dc, chunks=(r[s], r[s + 2]))
                                       for s, st in enumerate(plan.stages)))
    m = plan.num_microbatches
    for v in range(plan.pp * plan.virtual_per_stage):
        assert _gathers_read_off(plan, v) == comm.fsdp_gathers("zero3", m) == m + 1
    assert comm.fsdp_gathers("zero2", m) == 1 and comm.fsdp_gathers("replicate", m) == 0


def test_the_simulator_and_the_planner_price_a_stages_sync_in_one_function(monkeypatch):
    """sim.simulate and PlanningContext (allreduce, allreduce_span) both call
    costs.comm.region_sync_time, with the same collectives and spread, for a region plan and an
    ordinary one."""
    calls: list[tuple[str, tuple, float]] = []
    real = comm.region_sync_time

    def spy(collectives, spread, dc, link, tp=1):
        t = real(collectives, spread, dc, link, tp)
        calls.append((tuple(collectives), tuple(spread), t))
        return t

    monkeypatch.setattr(comm, "region_sync_time", spy)
    spec = load_spec(SPEC)
    base = plan_from_job(spec)
    region = base.with_(stages=tuple(StagePlan(dc="east", chunks=st.chunks) for st in base.stages),
                        replica_dcs=("east", "west"), links=(), name="tiny-region")
    for plan in (base, region):
        calls.clear()
        simulate(spec, plan)
        simulated = list(calls)
        assert [c[1] for c in simulated] == ([(("east", 1), ("west", 1))] * 2 if plan.replica_dcs
                                             else [((st.dc, 2),) for st in plan.stages])
        calls.clear()
        ctx = PlanningContext(spec)
        for st in plan.stages:
            if plan.replica_dcs:
                ctx.allreduce_span(st.chunks, ("east", "west"), (1, 1), plan.sharding, plan.num_microbatches)
            else:
                ctx.allreduce(st.chunks, plan.dp, st.dc, plan.sharding, plan.num_microbatches)
        assert calls == simulated


@pytest.mark.parametrize("sharding", ["zero1", "zero3"])
def test_dp_across_dcs_prices_the_sync_the_simulator_prices_for_its_region_plan(sharding):
    """The dp-across-dcs baseline's DP sync and WAN bytes are those of the region plan it
    describes (one stage, its replicas spread over the DCs): the simulator's sync event and
    layout.wan_bytes' count, zero3's m+1 gathers across the WAN included."""
    from geotrain.layout.wan_bytes import wan_bytes_per_direction
    from geotrain.planner.baselines import dp_across_dcs

    spec = load_spec(SPEC.parent / "llama2_7b_a100_3dc.toml")
    spec = replace(spec, job=spec.job.model_copy(update={"sharding": sharding, "checkpointing": "full"}))
    b = dp_across_dcs(spec)
    assert b.ok and f"full checkpointing, {sharding}" in b.note
    dp = sum(b.gpus_per_dc.values())
    m = spec.job.global_batch // (dp * spec.job.micro_batch)
    plan = Plan(stages=(StagePlan(dc=next(iter(b.gpus_per_dc)), chunks=((0, spec.model.num_units),)),), dp=dp,
                tp=1, micro_batch=spec.job.micro_batch, num_microbatches=m, precision=spec.job.precision,
                sharding=sharding, checkpointing="full", schedule="1f1b", name="dp-across",
                replica_dcs=tuple(d for d, n in b.gpus_per_dc.items() for _ in range(n)))
    res = simulate(spec, plan)
    assert b.sync_s == pytest.approx(_sync_events(res, plan)[0])
    assert b.wan_bytes == pytest.approx(sum(wan_bytes_per_direction(spec, plan).values()))
