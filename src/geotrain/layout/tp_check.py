"""Whether a plan's tensor (and expert) parallelism can run on a model and cluster, stage by stage.

A TP group is tp_s consecutive ranks of stage s (plan.Plan.rank), so it stays inside one node
exactly when tp_s divides the node's GPU count of the stage's DC; the heads, KV heads and FFN
width must split evenly over the TP ranks. The runtime refuses such a plan before any rank
starts (runtime/trainer.py), and `simulate` with it (commands/simulate_cmd.py): a plan file edited by
hand gets one line, not a shape error deep in a rank.
"""

from __future__ import annotations

from geotrain.spec.model import tp_split_widths as split_widths  # noqa: F401 -- the planner's name for it


def tp_problem(model, plan, cluster) -> str | None:
    """Why the plan's tp (per stage) cannot run on this model and cluster (one line), or None."""
    dcs = {d.name: d for d in cluster.datacenters}
    for s, st in enumerate(plan.stages):
        tp = plan.stage_tp(s)
        where = f"stage {s}"
        label = f"tp={tp}" + (f" of stage {s}" if plan.mixed_tp else "")
        if tp == 1:
            continue
        if tp < 1:
            return f"{label} must be at least 1"
        dc = dcs.get(st.dc)
        if dc is not None:   # an unknown DC is reported elsewhere
            if tp > dc.gpus_per_node:
                return (f"{label} is wider than a node of datacenter {dc.name} ({dc.gpus_per_node} GPUs per node, "
                        f"{where}); tensor parallelism stays inside a node")
            if dc.gpus_per_node % tp:
                return (f"{label} does not divide the {dc.gpus_per_node} GPUs per node of datacenter {dc.name} "
                        f"({where}): a TP group would straddle two nodes")
        for what, n in split_widths(model):
            if n % tp:
                return (f"{label} does not divide model {model.name}'s {what}={n}; tensor parallelism splits "
                        "them evenly")
    return ep_problem(model, plan)


def ep_problem(model, plan) -> str | None:
    """Why the plan's expert parallelism cannot run on this model (one line), or None. ep splits
    the experts over ep consecutive DP replicas of each stage."""
    ep = getattr(plan, "ep", 1)
    if ep == 1:
        return None
    experts = getattr(model, "experts", 0)
    if not experts:
        return f"ep={ep}: model {model.name} has no experts to split (expert parallelism needs a MoE model)"
    if experts % ep:
        return f"ep={ep} does not divide model {model.name}'s {experts} experts"
    if plan.dp % ep:
        return f"ep={ep} does not divide dp={plan.dp}: an EP group is ep replicas of a stage"
    if plan.mixed_tp:
        return f"ep={ep} with stages of different tp ({plan.tp_label()}) is not supported"
    if plan.sharding == "zero1":
        return f"ep={ep} with sharding zero1 is not supported (use replicate, zero2 or zero3)"
    return None
