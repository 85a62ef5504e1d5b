"""Simulate one DP replica when every replica must run the same timeline.

A plan's DP pipelines run the same program on alike GPUs; what can set them apart is only what
they share: a WAN link taken in turns (temporal sharing orders them), or start offsets. When
every WAN direction is shared fairly and every pipeline starts at once, the replicas are
interchangeable, so at every instant they are in the same state: d replicas' flows are active on
a link together, each at min(flow rate, capacity / (d x k)), where k is one replica's active
flows -- the rate one replica alone gets from a link of capacity / d. The DP collectives then
start when that replica reaches them (all do at once). So one replica on links of capacity / d
gives every replica's timeline, exactly up to float rounding, at 1/d of the work: for the
8,192-GPU example's fair finalists, one pipeline instead of 512.

The result is expanded back to every unit (the lists are shared, read-only), so the trace, the
metrics and the report see every GPU as before.
"""

from __future__ import annotations

from dataclasses import replace

from geotrain.sim.engine import EngineResult, run_engine
from geotrain.sim.program import Program


def replicas_alike(prog: Program, offsets: list[float]) -> bool:
    """Whether every DP replica runs the same timeline: fair sharing on every WAN direction
    (temporal turns order the replicas) and one start offset for all."""
    return prog.dp > 1 and all(w.sharing == "fair" for w in prog.wan) and len(set(offsets)) <= 1


def run_one_replica(prog: Program, offsets: list[float], progress: bool = False) -> EngineResult:
    """`run_engine(prog, offsets)` for a program whose replicas are alike (`replicas_alike`),
    by simulating one replica on links of 1/dp of the capacity."""
    dp = prog.dp
    one = Program(stages=prog.stages, dp=1, link_names=prog.link_names, link_meta=prog.link_meta,
                  wan=[replace(w, capacity=w.capacity / dp, priority=w.priority[:1]) for w in prog.wan])
    res = run_engine(one, offsets[:1], progress=progress)
    units = len(prog.stages) * dp
    return EngineResult(start=[res.start[u // dp] for u in range(units)],
                        arrival=[res.arrival[u // dp] for u in range(units)],
                        actions=res.actions * dp, wan_events=res.wan_events, wall_s=res.wall_s)
