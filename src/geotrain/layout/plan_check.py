"""Whether a plan can run at all, and whether it fits the experiment it is run with.

A plan file is data anyone can edit: `plan_fields.plan_field_problem` checks each field's type and
range as it is read (`plan.load_plan`), and `check_plan_for_spec` checks the plan against its spec -- the
cluster's datacenters, GPUs per DC, WAN links and their connection caps, the model's units and
heads -- so `simulate`, `train` and `rehearse` refuse a tampered or foreign plan in one line
before any rank starts or any event is simulated (a plan for 6 ranks on 4 GPUs, a layer cut twice,
100,000 connections or an offset of 1e308 s used to start, hang or spin).
"""

from __future__ import annotations

from geotrain.errors import GeotrainError
from geotrain.layout.plan_fields import plan_field_problem
from geotrain.layout.reach import reach_problem
from geotrain.layout.tp_check import tp_problem
from geotrain.spec.job import MAX_GLOBAL_BATCH


def plan_spec_problem(spec, plan) -> str | None:
    """Why `plan` cannot run on `spec`'s cluster and model (one line), or None."""
    problem = plan_field_problem(plan)
    if problem:
        return f"{problem[0]}: {problem[1]}"
    if plan.global_batch > MAX_GLOBAL_BATCH:
        return (f"dp x micro_batch x num_microbatches = {plan.global_batch} sequences per step, more than "
                f"{MAX_GLOBAL_BATCH}")
    cluster, model = spec.cluster, spec.model
    names = [d.name for d in cluster.datacenters]
    for s, st in enumerate(plan.stages):
        if st.dc not in names:
            return (f"stage {s} sits in {st.dc!r}, which is not a datacenter of cluster {cluster.name} "
                    f"({', '.join(names)})")
        if len(st.chunks) != plan.virtual_per_stage:
            return "every stage must hold the same number of model chunks"
    stray = sorted(set(plan.replica_dcs) - set(names))
    if stray:
        return f"replica_dcs names {', '.join(map(repr, stray))}, not a datacenter of cluster {cluster.name}"
    problem = tp_problem(model, plan, cluster)
    if problem:
        return problem
    for s in range(plan.pp - 1):
        a, b = plan.stages[s].dc, plan.stages[s + 1].dc
        if a != b and cluster.link(a, b) is None:
            return f"stages {s} and {s + 1} sit in {a} and {b}, which no WAN link joins"
    problem = reach_problem(plan, cluster)     # torch connects every pair of ranks: a 3-DC line cannot start
    if problem:
        return problem
    for i, lp in enumerate(plan.links):
        link = cluster.link(lp.src_dc, lp.dst_dc)
        if link is None:
            return (f"links[{i}] joins {lp.src_dc!r} and {lp.dst_dc!r}, which no WAN link of cluster {cluster.name} "
                    "joins")
        if lp.connections > link.max_connections:
            return (f"links[{i}] ({lp.src_dc}-{lp.dst_dc}) opens {lp.connections} connections, more than the link's "
                    f"max_connections {link.max_connections}")
    if plan.num_ranks > cluster.total_gpus:
        return f"needs {plan.num_ranks} GPUs, and cluster {cluster.name} has {cluster.total_gpus}"
    cut = [c for st in plan.stages for c in st.chunks]
    if sum(b - a for a, b in cut) != model.num_units or any(b <= a for a, b in cut) or \
            [u for a, b in plan.virtual_units() for u in range(a, b)] != list(range(model.num_units)):
        return (f"its stages do not cut the model's {model.num_units} units (0..{model.num_units - 1}) into "
                "consecutive pieces, each unit once; made for another model?")
    for dc, n in plan.gpus_per_dc().items():
        have = cluster.dc(dc).gpus
        if n > have:
            return f"needs {n} GPUs in {dc}, which has {have}"
    return None


def check_plan_for_spec(spec, plan) -> None:
    """Raise a one-line GeotrainError when `plan` cannot run on `spec` (see `plan_spec_problem`)."""
    problem = plan_spec_problem(spec, plan)
    if problem:
        raise GeotrainError(problem if problem.startswith("plan ") else
                            f"plan {plan.name if isinstance(plan.name, str) else '?'}: {problem}")
