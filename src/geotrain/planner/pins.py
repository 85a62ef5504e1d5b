"""What a job pins, and why a pin cannot be placed -- with each DC's numbers.

The search honours pins by enumerating only the layouts they allow; when none is left, the
generic "does not fit" would hide the arithmetic a person needs (how many stages of dp x tp GPUs
each DC holds, along which linked chain), so `pin_problem` says it first. `respects_pins` keeps
plans that ignore a pin (the baselines pick their own dp and schedule) out of a pinned job's choice.
"""

from __future__ import annotations

from geotrain.costs.activations import SELECTIVE
from geotrain.layout.plan import Plan
from geotrain.planner.context import PlanningContext
from geotrain.planner.placement import chains
from geotrain.spec.job import JobSpec

ZB_SELECTIVE = ("schedule zb-h1 cannot run with selective checkpointing (selective, keep-matmul, keep-attention): "
                "its split backward runs twice through a checkpointed region, which PyTorch refuses -- pin "
                "checkpointing none or full, or another schedule")


def pin_problem(ctx: PlanningContext) -> str | None:
    """Why the job's pins cannot be placed on the cluster, with each DC's arithmetic; None if the
    GPU counts allow them (memory is judged later, by the search)."""
    job, cl = ctx.job, ctx.cluster
    if job.schedule == "zb-h1" and job.checkpointing in SELECTIVE:
        return ZB_SELECTIVE
    if not ctx.sharding_options():
        what = f"tp={ctx.widest_tp}" if ctx.widest_tp > 1 else f"ep={ctx.ep}"
        return f"sharding zero1 does not run with {what} (the runtime refuses it): use replicate, zero2 or zero3"
    if job.dp is None and job.pp is None:
        return None
    dp, tp = job.dp or 1, ctx.tp
    per = dp * tp
    pins = " x ".join(f"{k}={v}" for k, v in (("pp", job.pp), ("dp", job.dp), ("tp", tp)) if v is not None)
    room = {d.name: d.gpus // per for d in cl.datacenters}
    arith = ", ".join(f"{d.name} {d.gpus} // {per} = {room[d.name]}" for d in cl.datacenters)
    if max(room.values()) == 0:
        big = max(cl.datacenters, key=lambda d: d.gpus)
        return (f"the pins {pins} need dp x tp = {per} GPUs for every stage inside one DC; the largest DC, "
                f"{big.name}, has {big.gpus}")
    if job.pp is not None:
        best, where = 0, ()
        for ch in chains(cl):
            n = sum(room[d] for d in ch)
            if all(room[d] > 0 for d in ch) and n > best:
                best, where = n, ch
        if best < job.pp:
            return (f"the pins {pins} need {job.pp} stages of dp x tp = {per} GPUs each, a stage inside one DC; "
                    f"stages each DC holds (GPUs // {per}): {arith}; "
                    f"the best linked chain ({'-'.join(where)}) holds {best} < {job.pp}"
                    + (" (a chain's datacenters must be linked pairwise: torch.distributed connects every pair of "
                       "ranks)" if any(cl.link(a, b) is None for a in room for b in room if a != b) else ""))
        mb = job.micro_batch if isinstance(job.micro_batch, int) else 1
        m = job.global_batch // (dp * mb)
        if job.schedule in ("1f1b", "wan-1f1b", "zb-h1", "interleaved") and m < job.pp:
            return (f"the pins {pins} leave global_batch {job.global_batch} / (dp {dp} x micro-batch {mb}) = {m} "
                    f"micro-batches, fewer than the {job.pp} stages {job.schedule} needs")
    return None


def respects_pins(plan: Plan, job: JobSpec) -> bool:
    """Does the plan keep every layout choice the job fixes?"""
    fixed = {"pp": job.pp, "dp": job.dp, "tp": job.tp if isinstance(job.tp, int) else None,
             "ep": job.ep if isinstance(job.ep, int) else None,
             "micro_batch": job.micro_batch if isinstance(job.micro_batch, int) else None,
             "schedule": None if job.schedule == "auto" else job.schedule,
             "checkpointing": None if job.checkpointing == "auto" else job.checkpointing,
             "sharding": None if job.sharding == "auto" else job.sharding}
    return all(v is None or getattr(plan, k) == v for k, v in fixed.items())
