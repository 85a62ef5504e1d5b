"""Stages of one plan at different tensor-parallel degrees (StagePlan.tp): the plan file, the rank
numbering, the checks that refuse an impossible tp in one line, and the simulator's costs at each
stage's own tp -- compute, memory, the TP all-reduces and the boundary bytes (one whole tensor to
each receiving TP rank where the tps differ, one tensor in 1/tp slices where equal, sim/program.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cases import case

from geotrain.costs import CostModel
from geotrain.errors import GeotrainError, SpecError
from geotrain.layout.plan import Plan, StagePlan, load_plan, save_plan
from geotrain.layout.price import wan_bytes_per_link
from geotrain.layout.tp_check import tp_problem
from geotrain.layout.wan_bytes import NORM_BYTES
from geotrain.sim import simulate
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"


def _plan(tps: tuple[int, int], dp: int = 1, m: int = 4) -> Plan:
    """Two stages of the tiny model, east then west, stage s at tps[s] (the plan's tp: stage 0's)."""
    spec = load_spec(SPEC)
    half = spec.model.num_units // 2
    stages = (StagePlan(dc="east", chunks=((0, half),)),
              StagePlan(dc="west", chunks=((half, spec.model.num_units),), tp=tps[1] if tps[1] != tps[0] else None))
    return Plan(stages=stages, dp=dp, tp=tps[0], micro_batch=2, num_microbatches=m, precision="fp32",
                sharding="replicate", name=f"tp{tps[0]}-{tps[1]}")


def test_stage_tp_numbers_ranks_per_stage_width_and_round_trips(tmp_path: Path) -> None:
    plan = _plan((2, 1), dp=1)
    assert plan.stage_tps == (2, 1) and plan.mixed_tp and plan.tp_label() == "per stage 2/1"
    assert plan.num_ranks == 3 and plan.gpus_per_dc() == {"east": 2, "west": 1}
    assert [plan.coords(r) for r in range(3)] == [(0, 0, 0), (0, 0, 1), (1, 0, 0)]
    wide = Plan(stages=(StagePlan("east", ((0, 2),)), StagePlan("west", ((2, 4),), tp=2)), dp=2, tp=1,
                micro_batch=1, num_microbatches=2)
    assert wide.rank_table == (((0,), (1,)), ((2, 3), (4, 5)))   # stage 1's TP groups after stage 0's dp x 1
    assert wide.ranks_of_dc("west") == [2, 3, 4, 5]
    save_plan(tmp_path / "p.json", plan)
    again, _ = load_plan(tmp_path / "p.json")
    assert again == plan
    # a plan file of one tp (no per-stage key, as older files are) reads as before
    doc = json.loads((tmp_path / "p.json").read_text())
    for st in doc["plan"]["stages"]:
        st.pop("tp")
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old, _ = load_plan(tmp_path / "old.json")
    assert not old.mixed_tp and old.num_ranks == 4 and old.rank(1, 0) == 2   # tp 2 everywhere


def test_an_impossible_stage_tp_is_one_line(tmp_path: Path) -> None:
    spec = load_spec(SPEC)
    plan = _plan((2, 1))
    save_plan(tmp_path / "p.json", plan)
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["plan"]["stages"][1]["tp"] = "two"
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(SpecError, match=r"plan.stages\[1\].tp.*integer from 1"):
        load_plan(tmp_path / "bad.json")
    # tiny_2dc's nodes hold 2 GPUs: tp 4 on stage 1 would straddle two
    wide = plan.with_(stages=(plan.stages[0], StagePlan("west", plan.stages[1].chunks, tp=4)))
    assert tp_problem(spec.model, wide, spec.cluster) == (
        "tp=4 of stage 1 is wider than a node of datacenter west (2 GPUs per node, stage 1); tensor parallelism "
        "stays inside a node")
    from geotrain.layout.plan_check import check_plan_for_spec
    with pytest.raises(GeotrainError, match="tp=4 of stage 1 is wider than a node"):
        check_plan_for_spec(spec, wide)


def test_train_refuses_mixed_tp_with_tied_embeddings_in_one_line(tmp_path: Path) -> None:
    """The runtime sums a tied model's first and last stage copies TP index by TP index, which
    stages of different tp do not pair; mixed plans of untied models train (test_runtime_stage_tp)."""
    tied = tmp_path / "tied.toml"
    text = SPEC.read_text().replace('model = "tiny"', 'model = { preset = "tiny", tie_embeddings = true }')
    tied.write_text(text.replace('cluster = "clusters/', f'cluster = "{SPEC.parent}/clusters/'))
    with pytest.raises(GeotrainError, match=r"tied embeddings with stages of different tp \(per stage 2/1\)"):
        case(tied, plan=_plan((2, 1)))
    assert case(SPEC, plan=_plan((2, 1))).plan.mixed_tp


def _norm_bytes(spec, plan) -> int:
    """The gradient norm's exchange over the east-west boundary, both ways: one float64 per replica
    to each receiving TP rank (layout.wan_bytes)."""
    return plan.dp * NORM_BYTES * (plan.stage_tp(0) + plan.stage_tp(1))


def test_simulator_prices_each_stage_at_its_own_tp() -> None:
    spec = load_spec(SPEC)
    cost = CostModel(spec.model, precision="fp32", checkpointing="none", optimizer=spec.job.optimizer)
    gpu = spec.cluster.gpu("cpu")
    east = spec.cluster.dc("east")
    mixed = simulate(spec, _plan((2, 1), dp=2), cost=cost)
    plan = mixed.plan
    c = mixed.trace.columns()
    assert sorted(set(c.rank.tolist())) == list(range(6))
    assert sorted(mixed.metrics.peak_memory) == list(range(6))
    # stage 0 runs at tp 2: its forward is the cost model's at tp 2 plus half its TP all-reduces
    units = range(*plan.stages[0].chunks[0])
    want = cost.stage_times(units, gpu, 2, 2).forward + cost.tp_comm_time(units, 2, 2, east) / 2
    fwd = c.kind_names.index("forward")
    on = (c.kind == fwd) & (c.rank == plan.rank(0, 1, 1))
    assert on.sum() == 4 and abs((c.end[on] - c.start[on]).mean() - want) < 1e-9
    # ... and its memory at tp 2, stage 1's at tp 1
    assert mixed.metrics.peak_memory[plan.rank(0, 0, 1)] < mixed.metrics.peak_memory[plan.rank(1, 0, 0)]
    # the WAN carries one copy per receiving TP rank: forward 1 (stage 1's), backward 2 (stage 0's)
    one = cost.boundary_bytes(2)
    norm = _norm_bytes(spec, plan)      # the gradient norm's float64s (clipping on by default)
    assert mixed.metrics.wan_bytes == 2 * 4 * one * (1 + 2) + norm
    assert wan_bytes_per_link(spec, plan) == {("east", "west"): 2 * 4 * one * (1 + 2) + norm}


def test_tied_models_are_planned_at_one_tp(tmp_path: Path) -> None:
    """A tied model gets one tp for every stage from the planner and from `train SPEC`'s layout
    (what the runtime trains); an untied one gets each kind of DC's own."""
    from _small_clusters import mesh, write_spec

    from geotrain.planner.context import planning_contexts
    from geotrain.planner.manual import plan_from_job

    job = {"global_batch": 4, "micro_batch": 1, "precision": "bf16", "checkpointing": "none",
           "sharding": "replicate", "tp": "auto"}
    dcs = [("A", "h100-80g", 8, 8), ("B", "h100-80g", 4, 2)]   # the best estimate: tp 4 on A, 2 on B
    spec = write_spec(tmp_path / "untied", dcs, mesh(["A", "B"], 2, 200, 50), "llama2-7b", job)
    assert plan_from_job(spec).mixed_tp
    tied = write_spec(tmp_path / "tied", dcs, mesh(["A", "B"], 2, 200, 50), "llama2-7b", job)
    text = (tmp_path / "tied" / "spec.toml").read_text()
    (tmp_path / "tied" / "spec.toml").write_text(
        text.replace('model = "llama2-7b"', 'model = { preset = "llama2-7b", tie_embeddings = true }'))
    tied = load_spec(tmp_path / "tied" / "spec.toml")
    assert tied.model.tie_embeddings and not plan_from_job(tied).mixed_tp
    assert all(ctx.uniform_tp for ctx in planning_contexts(tied))
    assert not all(ctx.uniform_tp for ctx in planning_contexts(spec))


def test_equal_tp_boundary_moves_one_copy_then_gathers() -> None:
    """tp 2 on both sides: the boundary moves 1/tp slices (runtime/interpreter.py), so the WAN carries
    one tensor per micro-batch and direction, not one per receiving TP rank; the receiver's TP
    all-gather is priced after each receive; the planner's boundary estimate counts the same bytes."""
    from geotrain.costs.comm import ring_half
    from geotrain.planner.context import PlanningContext
    from geotrain.planner.plan_score import plan_layout
    from geotrain.planner.scorer import Scorer

    spec = load_spec(SPEC)
    cost = CostModel(spec.model, precision="fp32", checkpointing="none", optimizer=spec.job.optimizer)
    res = simulate(spec, _plan((2, 2), dp=2), cost=cost)
    one = cost.boundary_bytes(2)
    norm = _norm_bytes(spec, res.plan)
    assert res.metrics.wan_bytes == 2 * 4 * one * 2 + norm        # dp 2 x m 4 x one copy x both directions
    assert wan_bytes_per_link(spec, res.plan) == {("east", "west"): 2 * 4 * one * 2 + norm}
    west = spec.cluster.dc("west")
    gather = ring_half(one, 2, west.intra_node_gbps * 1e9 / 8, west.intra_dc_latency_us * 1e-6)
    c = res.trace.columns()
    waits = (c.kind == c.kind_names.index("recv_wait")) & (c.rank == res.plan.rank(1, 0, 0))
    assert gather > 0 and ((c.end[waits] - c.start[waits]) >= gather - 1e-12).sum() >= 4
    # the planner: same flows as a tp 1 -> 2 boundary (two receiving TP ranks), half its bytes
    occupancy = {}
    for tps in ((1, 2), (2, 2)):
        plan = _plan(tps, dp=2)
        ctx = PlanningContext(spec).for_plan(plan)
        bounds, _ = Scorer(ctx, kinds=("1f1b",)).boundaries(plan_layout(plan), "fair", (4,), 1)
        occupancy[tps] = bounds[0].occupancy
    assert occupancy[(2, 2)] > 0 and abs(2 * occupancy[(2, 2)] - occupancy[(1, 2)]) < 1e-12, occupancy


def test_temporal_turn_of_an_equal_tp_boundary_is_one_slice() -> None:
    """Under temporal sharing each TP index takes its own turns; between stages of equal tp a turn
    carries a 1/tp slice, so the planned stagger is half a tp 1 -> 2 boundary's (a whole copy each)."""
    from geotrain.layout.plan import LinkPlan
    from geotrain.planner.sharing import apply_temporal

    spec = load_spec(SPEC)
    link = (LinkPlan(src_dc="east", dst_dc="west", connections=4),)
    stagger = {tps: apply_temporal(_plan(tps, dp=2).with_(links=link), spec.cluster, 1 << 20, 0.0).links[0].stagger_s
               for tps in ((1, 2), (2, 2))}
    assert stagger[(1, 2)] > 0 and abs(2 * stagger[(2, 2)] - stagger[(1, 2)]) < 1e-12, stagger


def test_score_plan_prices_each_stage_at_its_own_tp_in_one_dc(tmp_path: Path) -> None:
    """A hand-made plan with stages of tp 2 and tp 1 in one DC: the planner's estimate prices each
    stage at its own tp (compute, TP all-reduces, sync, optimizer) as the simulator does, and the
    tp 2 -> 1 boundary as one whole tensor inside the DC (not scattered: the tps differ)."""
    from geotrain.costs.comm import GBIT
    from geotrain.planner.analytic import BoundaryCosts, StageTerms, estimate
    from geotrain.planner.context import PlanningContext
    from geotrain.planner.plan_score import plan_stage_costs, score_plan

    path = tmp_path / "one_dc.toml"
    path.write_text(SPEC.read_text().split("[job]")[0].replace('cluster = "clusters/tiny_2dc.toml"', "")
                    + """[job]
global_batch = 16
micro_batch = 2
precision = "fp32"
sharding = "replicate"
schedule = "1f1b"
[cluster]
name = "one-dc"
[[cluster.datacenters]]
name = "east"
gpu_type = "cpu"
gpus = 8
gpus_per_node = 2
intra_node_gbps = 40
intra_dc_gbps = 10
intra_dc_latency_us = 50
""")
    spec = load_spec(path)
    n = spec.model.num_units
    plan = Plan(stages=(StagePlan("east", ((0, n // 2),)), StagePlan("east", ((n // 2, n),), tp=1)), dp=2, tp=2,
                micro_batch=2, num_microbatches=4, precision="fp32", sharding="replicate", schedule="1f1b")
    res = simulate(spec, plan)

    def first(s: int, kind: str) -> float:
        return next(e.duration for e in res.trace.events if e.rank == plan.rank(s, 0) and e.kind == kind)

    sim = [StageTerms(first(s, "forward"), first(s, "backward"), 0.0, 0.0, first(s, "allreduce"),
                      first(s, "optimizer")) for s in range(2)]
    costs = plan_stage_costs(PlanningContext(spec), plan)
    for got, want in zip(costs, sim):
        assert (got.forward, got.backward, got.allreduce, got.optimizer) == pytest.approx(
            (want.forward, want.backward, want.allreduce, want.optimizer))
    one = CostModel(spec.model, precision="fp32").boundary_bytes(2)
    hop = 50e-6 + one / (10 * GBIT)   # a whole tensor over the intra-DC network
    assert first(0, "transfer") == pytest.approx(hop)
    want = estimate(costs, [BoundaryCosts(False, hop, 0.0)], 4, "1f1b")
    assert score_plan(PlanningContext(spec), plan).est.total == pytest.approx(want.total)
