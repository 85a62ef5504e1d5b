"""Region plans: DP across the DCs of one region, where their links are fast enough.

Llama-2-7B on the 3-DC A100 example with its DCs in one region: at 200 and 400 Gbit/s links the
planner's plan must be at least as fast as pure DP across the DCs (it was 0.9x of it when DP
could not cross a DC); over WAN-slow links it keeps every DP replica inside its DC (Atlas)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from geotrain.costs import comm
from geotrain.layout.plan import load_plan, save_plan
from geotrain.planner.confirm import evaluate_baselines, make_plan
from geotrain.sim import simulate
from geotrain.spec import load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _three_dc(tmp_path: Path, capacity: float | None, per_connection: float | None, region: bool = True):
    shutil.copytree(EXAMPLES, tmp_path / "ex")
    path = tmp_path / "ex/clusters/a100_3dc.toml"
    text = path.read_text()
    if region:
        text = text.replace("price_per_gpu_hour", 'region = "us"\nprice_per_gpu_hour')
    if capacity is not None:
        text = re.sub(r"capacity_gbps = \d+", f"capacity_gbps = {capacity}", text)
        text = re.sub(r"per_connection_gbps = \d+", f"per_connection_gbps = {per_connection}", text)
    path.write_text(text)
    return load_spec(tmp_path / "ex/llama2_7b_a100_3dc.toml")


@pytest.mark.parametrize("gbps", [200, 400])
def test_fast_regional_links_beat_dp_across_dcs(tmp_path, gbps):
    spec = _three_dc(tmp_path, gbps, 25)
    res = make_plan(spec)
    dp_across = next(b for b in evaluate_baselines(spec) if b.name == "dp-across-dcs")
    assert res.plan.replica_dcs, "expected DP spread over the region's DCs"
    assert res.explanation[0].startswith("DP across a region"), res.explanation[0]   # not "Pipeline over a100-a"
    assert res.iteration_s <= dp_across.iteration_s, (res.iteration_s, dp_across.iteration_s)
    # the plan file carries it; the simulator prices the cross-DC sync from it alone
    save_plan(tmp_path / "plan.json", res.plan, spec=spec)
    plan, _ = load_plan(tmp_path / "plan.json")
    assert plan.replica_dcs == res.plan.replica_dcs
    assert simulate(spec, plan).iteration_time == pytest.approx(res.iteration_s)
    assert sum(plan.gpus_per_dc().values()) == plan.num_ranks


def test_wan_slow_links_keep_dp_inside_dcs(tmp_path):
    spec = _three_dc(tmp_path, 10, 1)
    res = make_plan(spec)
    assert not res.plan.replica_dcs


def test_cross_dc_sync_prices_the_slowest_link(tmp_path):
    spec = _three_dc(tmp_path, None, None, region=False)
    cl = spec.cluster
    east, central = cl.dc("us-east"), cl.dc("us-central")
    link = cl.link("us-east", "us-central")          # 200 Gbit/s, 5 per connection, 14 ms
    nbytes = 1e9
    allreduce = comm.sync_collectives("replicate", [(nbytes, nbytes)], 1)
    one = comm.cross_dc_sync_time(allreduce, [(east, 8)], [])
    assert one == comm.dp_sync_time(allreduce, 8, east)
    two = comm.cross_dc_sync_time(allreduce, [(east, 8), (central, 8)], [link])
    intra = comm.hierarchical_half(nbytes, 8, 8, east)
    wan = 0.5 * nbytes / (min(8 * 5, 200) * comm.GBIT) + 0.014
    assert two == pytest.approx(2 * (intra + wan))
    slow = cl.link("us-east", "us-west")             # 50 Gbit/s, 34 ms: the ring's slowest hop
    assert comm.cross_dc_sync_time(allreduce, [(east, 8), (central, 8)], [link, slow]) > two


def _plan(pp: int, dp: int, tp: int, replica_dcs: tuple[str, ...] = ()):
    from geotrain.layout.plan import Plan, StagePlan

    dcs = ("A",) * pp if replica_dcs else tuple("AB"[s * 2 // pp] for s in range(pp))
    stages = tuple(StagePlan(dc=dcs[s] if not replica_dcs else replica_dcs[0], chunks=((s, s + 1),))
                   for s in range(pp))
    return Plan(stages=stages, dp=dp, micro_batch=1, num_microbatches=4, tp=tp, replica_dcs=replica_dcs)


@pytest.mark.parametrize("replica_dcs", [("A", "A", "B"), ("A", "B", "A", "C", "B")])
def test_region_plan_ranks_are_contiguous_per_dc(replica_dcs):
    """One torchrun per DC numbers its node's ranks contiguously: a region plan must too
    (pipeline-major, pipelines grouped by DC), and rank/coords must round-trip."""
    plan = _plan(2, len(replica_dcs), 2, replica_dcs)
    seen = []
    for r in range(plan.num_ranks):
        s, d, t = plan.coords(r)
        assert plan.rank(s, d, t) == r
        seen.append(plan.dc_of(s, d))
    runs = [dc for i, dc in enumerate(seen) if i == 0 or seen[i - 1] != dc]
    assert len(runs) == len(set(replica_dcs)), seen
    assert sorted({plan.rank(s, d, t) for s in range(2) for d in range(plan.dp) for t in range(2)}) \
        == list(range(plan.num_ranks))
    assert [plan.dc_of_rank(r) for r in range(plan.num_ranks)] == seen
    ranks = plan.ranks_of_dc("A")
    assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    # a pipeline's stages are neighbours: replica 0's stage 1 follows its stage 0 (TP innermost)
    assert plan.rank(1, 0, 0) == plan.rank(0, 0, 1) + 1


def test_ordinary_plan_numbering_is_unchanged():
    plan = _plan(4, 3, 2)
    for s in range(4):
        for d in range(3):
            for t in range(2):
                r = (s * 3 + d) * 2 + t
                assert plan.rank(s, d, t) == r and plan.coords(r) == (s, d, t)
