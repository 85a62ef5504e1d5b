"""DiLoCo's workers and outer optimizer as a plan states them (layout.plan.Plan.outer).

A DiLoCo plan trains `num_workers` replicas of one layout -- the plan's pp x dp x tp, each worker
in its own DCs -- that exchange only the outer pseudo-gradient every H inner steps; the
worker's view of the plan (`Plan.worker_plan`) is an ordinary plan its ranks run as one job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from geotrain.costs.compression import OUTER_CODECS


@dataclass(frozen=True)
class OuterPlan:
    """DiLoCo across workers: each worker trains its own replica of the plan's layout (pp x dp x tp)
    for `inner_steps` (H) steps; then the outer pseudo-gradient (the parameters at the last sync
    minus the worker's) is averaged over the workers and applied by an outer Nesterov SGD.

    workers: per worker, the DC of each pipeline stage (worker 0's are the plan's stages' DCs); a
    worker spanning several DCs is the hybrid: pipelines across near DCs, DiLoCo between groups.
    fragments (F): streaming DiLoCo, the parameters in F fragments synced in turn, H / F steps
    apart; overlap: inner steps each fragment's exchange runs beside before it is applied (0: the
    workers wait for it); mix: with overlap, the weight of the worker's own progress when the
    averaged fragment is merged in. compression: the outer gradients on the wire
    (costs.compression.OUTER_CODECS); connections / sharing: of each cross-worker transfer."""

    workers: tuple[tuple[str, ...], ...]
    inner_steps: int = 32
    fragments: int = 1
    overlap: int = 0
    mix: float = 0.5
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    compression: str = "fp32"
    connections: int = 4
    sharing: str = "fair"

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def fragment_offset(self, f: int) -> int:
        """Inner steps after a period's start at which fragment f is synced (the last at H)."""
        return (f + 1) * self.inner_steps // self.fragments

    def syncs_after(self, step: int) -> list[int]:
        """The fragments whose exchange starts after inner step `step` (1-based)."""
        h = self.inner_steps
        return [f for f in range(self.fragments)
                if step >= self.fragment_offset(f) and (step - self.fragment_offset(f)) % h == 0]



def describe_outer(o: OuterPlan) -> str:
    """The mode in one line (simulate's summary, the launcher's first line): the workers' DCs and
    how often, what and how they exchange."""
    groups = " | ".join("+".join(dict.fromkeys(w)) for w in o.workers)
    when = f"one of {o.fragments} fragments" if o.fragments > 1 else "an exchange"
    when += f" every {o.inner_steps // o.fragments} steps"
    if o.overlap:
        when += f", overlapping {o.overlap} inner step(s)"
    outer = f"SGD lr {o.lr:g}" + (f" momentum {o.momentum:g}" if o.momentum else "")
    outer = ("Nesterov " if o.nesterov and o.momentum else "") + outer
    return (f"DiLoCo, {o.num_workers} workers ({groups}): H={o.inner_steps} ({when}), outer gradients "
            f"{o.compression}, outer {outer}")

def outer_problem(o: OuterPlan, pp: int, replica_dcs: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(field, reason) for the first impossible field of an OuterPlan, else None."""
    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if len(o.workers) < 1:
        return "workers", "a DiLoCo plan needs at least one worker"
    for w, dcs in enumerate(o.workers):
        if len(dcs) != pp or not all(isinstance(d, str) for d in dcs):
            return f"workers[{w}]", f"must name the DC of each of the {pp} stages (got {list(dcs)!r})"
    if replica_dcs:
        return "workers", "DiLoCo workers of a region plan are not supported (give each worker its stages' DCs)"
    for name in ("inner_steps", "fragments", "connections"):
        v = getattr(o, name)
        if not is_int(v) or v < 1:
            return name, f"must be an integer >= 1 (got {v!r})"
    if not is_int(o.overlap) or o.overlap < 0:
        return "overlap", f"must be an integer >= 0 (got {o.overlap!r})"
    if o.inner_steps % o.fragments:
        return "fragments", f"must divide inner_steps={o.inner_steps} (got {o.fragments})"
    if o.overlap >= o.inner_steps // o.fragments and o.overlap:
        return "overlap", (f"must be below inner_steps / fragments = {o.inner_steps // o.fragments} (a fragment's "
                           f"exchange must be applied before its next one starts; got {o.overlap})")
    for name in ("lr", "momentum", "mix"):
        v = getattr(o, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            return name, f"must be a finite number >= 0 (got {v!r})"
    if o.momentum >= 1 or o.mix > 1:
        return ("momentum" if o.momentum >= 1 else "mix"), "must be below 1" if o.momentum >= 1 else "must be <= 1"
    if o.compression not in OUTER_CODECS:
        return "compression", f"must be one of {', '.join(OUTER_CODECS)} (got {o.compression!r})"
    if o.sharing not in ("fair", "temporal"):
        return "sharing", f"must be fair or temporal (got {o.sharing!r})"
    return None
