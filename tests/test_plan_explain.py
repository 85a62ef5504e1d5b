"""The explanation's lower bound prices each stage the way the plan runs it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from geotrain.planner.context import PlanningContext
from geotrain.planner.explain import analyse
from geotrain.planner.manual import plan_from_job
from geotrain.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def test_lower_bound_counts_each_stages_checkpointing():
    """Stage 0 recomputes (full checkpointing), stage 1 does not: the busiest GPU's compute is
    stage 0's at full checkpointing. Priced at the plan-wide mode ("none") the bound came out
    below what stage 0 alone must compute."""
    spec = load_spec(ROOT / "examples" / "tiny_2dc.toml")
    plan = plan_from_job(spec)
    plan = plan.with_(checkpointing="none", stages=(replace(plan.stages[0], checkpointing="full"),
                                                    *plan.stages[1:]))
    ctx = PlanningContext(spec, None, tp=plan.tp)
    _, parts, _, _ = analyse(ctx, plan, None, None)
    expect = []
    for s, st in enumerate(plan.stages):
        tab = ctx.table(ctx.dc(st.dc).gpu_type, plan.micro_batch, plan.stage_checkpointing(s))
        step = sum(tab.step[b] - tab.step[a] for a, b in st.chunks)
        expect.append(plan.num_microbatches * step + ctx.optimizer(st.chunks, st.dc, plan.sharding, plan.dp))
    assert parts["compute"] == max(expect)
    full0 = ctx.table(ctx.dc(plan.stages[0].dc).gpu_type, plan.micro_batch, "full")
    none0 = ctx.table(ctx.dc(plan.stages[0].dc).gpu_type, plan.micro_batch, "none")
    assert full0.step[-1] > none0.step[-1]   # the case can tell the two pricings apart
