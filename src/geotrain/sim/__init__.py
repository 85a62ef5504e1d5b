"""The discrete-event simulator: a plan's schedule on the cluster, GPU by GPU and link by link.

Resources: each GPU's compute, intra-DC transfers (latency + bytes / bandwidth, no contention),
each direction of each WAN link (one-way latency, capacity, per-connection cap, n connections;
fair or temporal sharing), and the DP reduction inside a DC. Every time and byte count comes from
a `layout.stage_costs.StageCosts` (analytic or calibrated). The result is a trace in the shared
schema plus its metrics.
"""

from geotrain.sim.simulate import SimResult, StageCost, plan_schedule, simulate, simulate_costs

__all__ = ["SimResult", "StageCost", "plan_schedule", "simulate", "simulate_costs"]
