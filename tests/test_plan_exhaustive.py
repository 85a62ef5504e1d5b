"""The planner against the exhaustive optimum: on small clusters every plan the job allows is
listed (geotrain.planner.exhaustive) and simulated; the planner's choice must be within 1% of the
fastest. (This replaces "never slower than the baselines", which held by construction: the
baselines are among the planner's finalists.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from _small_clusters import mesh, write_spec

from geotrain.costs import CostModel
from geotrain.planner.confirm import make_plan
from geotrain.planner.exhaustive import all_plans, compositions
from geotrain.sim import simulate

JOB = {"global_batch": 8, "micro_batch": 1, "precision": "bf16", "checkpointing": "none"}
CASES = {
    # two equal A100 DCs on a 10 Gbit/s link: PP across the WAN, dp and sharding open
    "2dc": ([("A", "a100-80g", 4), ("B", "a100-80g", 4)], mesh(["A", "B"], 20, 10, 2), JOB),
    # H100 beside A100s, a full mesh: stage counts and chain order across GPU types
    "3dc-mixed": ([("A", "h100-80g", 2), ("B", "a100-80g", 4), ("C", "a100-80g", 2)], mesh(["A", "B", "C"], 15, 25, 5),
                  {**JOB, "sharding": "zero1"}),
    # a line A-B-C with slow links and a 40 GB DC, full checkpointing
    "3dc-line": ([("A", "a100-80g", 4), ("B", "a100-80g", 2), ("C", "a100-40g", 4)],
                 [("A", "B", 10, 5, 1), ("B", "C", 30, 2, 1)], {**JOB, "checkpointing": "full", "sharding": "zero1"}),
    # tp = "auto" on H100 DCs of 4-GPU and 2-GPU nodes and a batch of 4: tensor parallelism is what
    # uses the GPUs, and each kind of DC may have its own (the optimum was pp3 x dp1 at tp 4/2/2 while
    # every boundary moved whole copies; with equal-tp boundaries scattered it is tp 2 throughout);
    # the exhaustive list holds every per-DC tp too
    "2dc-tp": ([("A", "h100-80g", 4, 4), ("B", "h100-80g", 4, 2)], mesh(["A", "B"], 2, 200, 50),
               {**JOB, "global_batch": 4, "sharding": "replicate", "tp": "auto"}),
    # OPT-350M on two A100 DCs of one region (region layouts enumerated too): the estimate put
    # wan-1f1b first, zb-h1 of the same layout simulated 2% faster -- the best layout's other kinds
    # are finalists now
    "2dc-region": ([("A", "a100-80g", 4), ("B", "a100-80g", 4)], mesh(["A", "B"], 5, 100, 12.5),
                   {**JOB, "global_batch": 16, "sharding": "zero1"}, "opt"),
}
OPT = str(Path(__file__).resolve().parents[1] / "examples/models/opt_350m_shape.toml")


def test_compositions_are_all_and_only_the_bounded_ones():
    got = sorted(compositions(5, [3, 1, 2]))
    want = sorted((a, b, c) for a in range(1, 4) for b in range(1, 2) for c in range(1, 3) if a + b + c == 5)
    assert got == want == [(2, 1, 2), (3, 1, 1)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_planner_is_within_one_percent_of_the_exhaustive_optimum(name, tmp_path):
    dcs, links, job, *opt = CASES[name]
    spec = write_spec(tmp_path, dcs, links, OPT if opt else "llama2-7b", job, name=name,
                      region="r1" if opt else None)
    plans = all_plans(spec)
    assert len(plans) > 50  # the space is really enumerated, not a handful
    costs = {c: CostModel(spec.model, precision="bf16", checkpointing=c, optimizer=spec.job.optimizer)
             for c in {p.checkpointing for p in plans}}
    best = min(simulate(spec, p, cost=costs[p.checkpointing]).metrics.iteration_time for p in plans)
    res = make_plan(spec)
    chosen = res.iteration_s
    assert chosen <= best * 1.01, f"planner {chosen:.4f} s vs exhaustive optimum {best:.4f} s"
    if job.get("tp") == "auto":
        assert {p.stage_tp(s) for p in plans for s in range(p.pp) if p.stages[s].dc == "A"} == {1, 2, 4}
        assert {p.stage_tp(s) for p in plans for s in range(p.pp) if p.stages[s].dc == "B"} == {1, 2}
        fastest = min(plans, key=lambda p: simulate(spec, p, cost=costs[p.checkpointing]).metrics.iteration_time)
        # the planner picks the optimum's tps (since equal-tp boundaries move 1/tp slices, tp 2/2)
        assert fastest.tp_label() == res.plan.tp_label(), (fastest.tp_label(), res.plan.tp_label())
        # the runtime's rules: no ZeRO-1 under tensor parallelism (runtime/trainer.py refuses it)
        assert all(p.sharding != "zero1" for p, _ in res.simulated if max(p.stage_tps) > 1)
