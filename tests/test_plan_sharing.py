"""The planner picks fair sharing where temporal turns do not pay and temporal where they do.

tiny_2dc's boundary tensor is 16 KiB: at the link's own 1 Gbit/s it crosses in 0.13 ms, less than
a turn costs (the arbiter's grant, `transport.turns.TURN_OVERHEAD_S`): fair sharing. Scaled to
2 Mbit/s (as `bench/bench_rehearse.py` runs it) a transfer takes 65 ms and two pipelines saturate
the link: temporal turns, and the simulator says why (the fair variant simulated slower).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from geotrain.planner.confirm import make_plan
from geotrain.spec import load_spec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_2dc.toml"


def _scaled(k: float):
    spec = load_spec(SPEC)
    links = [ln.model_copy(update={"capacity_gbps": ln.capacity_gbps * k,
                                   "per_connection_gbps": ln.per_connection_gbps * k})
             for ln in spec.cluster.wan_links]
    return dataclasses.replace(spec, cluster=spec.cluster.model_copy(update={"wan_links": links}))


@pytest.mark.parametrize("scale, sharing", [(1.0, "fair"), (0.002, "temporal")])
def test_fair_where_turns_cost_more_than_they_save_temporal_where_the_link_saturates(scale, sharing):
    res = make_plan(_scaled(scale))
    assert res.plan.dp > 1 and res.plan.links
    assert {lp.sharing for lp in res.plan.links} == {sharing}
    by_name = {p.name: t for p, t in res.simulated}
    if sharing == "temporal":      # the fair variant was simulated beside it, and lost
        fair = [t for name, t in by_name.items() if name.endswith("-fair")]
        assert fair and min(fair) > res.iteration_s

