"""A plan taken straight from the job spec (fixed pp/dp), with an even layer split.

This is what `simulate` and `train` use when the user pins the layout, and the starting
point the planner improves on: it makes no search, only the obvious choices.
"""

from __future__ import annotations

from geotrain.config.load import Spec
from geotrain.errors import InfeasibleError
from geotrain.plan.plan import LinkPlan, Plan, StagePlan


def split_even(num_units: int, parts: int) -> list[tuple[int, int]]:
    """Cut units 0..num_units into `parts` contiguous, near-equal ranges."""
    if parts > num_units:
        raise InfeasibleError(f"cannot cut {num_units} model units into {parts} pipeline stages")
    base, extra = divmod(num_units, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def assign_stages_to_dcs(gpus: list[int], pp: int) -> list[int]:
    """Index of the DC of each stage: DCs in order, stage counts proportional to GPU counts,
    every DC at least one stage while stages remain."""
    n = len(gpus)
    if pp < n:
        counts = [1] * pp + [0] * (n - pp)
    else:
        total = sum(gpus)
        counts = [max(1, round(pp * g / total)) for g in gpus]
        while sum(counts) > pp:
            counts[max(range(n), key=lambda i: counts[i])] -= 1
        while sum(counts) < pp:
            counts[max(range(n), key=lambda i: gpus[i] / counts[i])] += 1
    return [i for i, c in enumerate(counts) for _ in range(c)]


def plan_from_job(spec: Spec, schedule: str | None = None, virtual_per_stage: int = 1) -> Plan:
    job, cluster = spec.job, spec.cluster
    dcs = cluster.datacenters
    pp = job.pp or len(dcs)
    stage_dc = assign_stages_to_dcs([d.gpus for d in dcs], pp)
    per_dc = {i: stage_dc.count(i) for i in set(stage_dc)}
    dp = job.dp or min(dcs[i].gpus // (c * job.tp) for i, c in per_dc.items())
    if dp < 1:
        raise InfeasibleError("a datacenter has fewer GPUs than the stages placed on it need")
    for i, c in per_dc.items():
        if c * dp * job.tp > dcs[i].gpus:
            raise InfeasibleError(
                f"datacenter {dcs[i].name} has {dcs[i].gpus} GPUs but {c} stages x dp={dp} x tp={job.tp} "
                f"need {c * dp * job.tp}")
    mb = job.micro_batch if isinstance(job.micro_batch, int) else 1
    if job.global_batch % (dp * mb):
        raise InfeasibleError(f"global_batch={job.global_batch} is not a multiple of dp={dp} x micro_batch={mb}")
    m = job.global_batch // (dp * mb)
    ranges = split_even(spec.model.num_units, pp * virtual_per_stage)
    stages = tuple(
        StagePlan(dc=dcs[stage_dc[s]].name, chunks=tuple(ranges[c * pp + s] for c in range(virtual_per_stage)))
        for s in range(pp)
    )
    links = []
    for s in range(pp - 1):
        a, b = stages[s].dc, stages[s + 1].dc
        if a != b:
            wl = cluster.link(a, b)
            if wl is None:
                raise InfeasibleError(f"stages {s} and {s + 1} sit in {a} and {b}, which no WAN link joins")
            links.append(LinkPlan(src_dc=a, dst_dc=b, connections=wl.connections_to_saturate(), sharing="fair"))
    kind = schedule or (job.schedule if job.schedule != "auto" else "1f1b")
    return Plan(
        stages=stages, dp=dp, tp=job.tp, micro_batch=mb, num_microbatches=m, schedule=kind,
        precision=job.precision,
        checkpointing=job.checkpointing if job.checkpointing != "auto" else "none",
        sharding=job.sharding if job.sharding != "auto" else "replicate",
        links=tuple(links), name=f"{spec.name}-manual",
    )
