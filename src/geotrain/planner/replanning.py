"""Re-plan a run for the cluster left after losing datacenters or GPUs.

The run's own plan and spec say what was trained (model, global batch, precision, optimizer);
the cluster is cut down (DCs dropped with their WAN links, GPU counts changed) or replaced by a
new spec's, the job's pinned pp and dp are released -- they described the cluster that is gone --
and the planner searches again. Both plans are simulated so the change in iteration time is a
prediction of the same kind. Used by `geotrain replan` and by `train --elastic` (`elastic`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from geotrain.console import human_seconds
from geotrain.errors import GeotrainError, InfeasibleError
from geotrain.layout.plan import load_plan, plan_spec
from geotrain.planner.confirm import make_plan
from geotrain.sim import simulate
from geotrain.spec.load import load_spec


@dataclass
class Replan:
    """The plan before and after, each with its simulated iteration time (seconds)."""

    spec_before: object
    spec_after: object
    before: object                      # Plan
    after: object                       # Plan
    before_s: float
    after_s: float
    spec_path: str | None             # the TOML the experiment came from (the plan file embeds it)
    dropped: list[str] = field(default_factory=list)


def run_plan(run_dir: Path):
    """(plan, spec) a run was trained with, from RUN_DIR/plan.json (the spec it embeds, else the
    TOML it names)."""
    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        raise GeotrainError(f"{run_dir}: no plan.json (not a `geotrain train` run directory)")
    plan, doc = load_plan(path)
    return plan, plan_spec(doc, path)


def cluster_left(spec, without: list[str], gpus: dict[str, int]):
    """`spec` with the named DCs (and their WAN links) gone and GPU counts changed."""
    cl = spec.cluster
    names = [d.name for d in cl.datacenters]
    for name in [*without, *gpus]:
        if name not in names:
            raise GeotrainError(f"unknown datacenter {name!r} (this cluster has {', '.join(names)})")
    gone = set(without) | {n for n, g in gpus.items() if g == 0}
    dcs = [{**d.model_dump(), **({"gpus": gpus[d.name]} if d.name in gpus else {})}
           for d in cl.datacenters if d.name not in gone]
    if not dcs:
        raise GeotrainError(f"nothing is left of cluster {cl.name!r} without {', '.join(sorted(gone))}")
    links = [lk.model_dump() for lk in cl.wan_links if not set(lk.between) & gone]
    try:
        cluster = cl.model_validate({**cl.model_dump(), "datacenters": dcs, "wan_links": links})
    except ValueError as e:          # pydantic's ValidationError is a ValueError
        raise GeotrainError(f"the cluster left is not valid: {' '.join(str(e).split())}") from None
    return replace(spec, cluster=cluster), sorted(gone)


def replan(run_dir: Path, without: list[str] = (), gpus: dict[str, int] | None = None,
           new_spec: str | None = None, top_k: int = 2) -> Replan:
    """Re-plan RUN_DIR's training for the cluster that is left (see the module docstring)."""
    before, spec = run_plan(Path(run_dir))
    spec_path = str(spec.path) if spec.path else None
    base = spec
    if new_spec:
        base = load_spec(new_spec)
        if _shape(base.model) != _shape(spec.model):
            raise GeotrainError(f"--spec {new_spec}: its model ({base.model.name}) is not the run's "
                                f"({spec.model.name}); a checkpoint only resumes into the same model")
        if base.job.global_batch != before.global_batch:
            raise GeotrainError(f"--spec {new_spec}: global_batch={base.job.global_batch}, the run trains "
                                f"{before.global_batch}; keep it (the optimizer state and the loss curve assume it)")
        spec_path = str(Path(new_spec).resolve())
    left, dropped = cluster_left(base, list(without), gpus or {})
    # What the run trained stays pinned; pp and dp described the cluster that changed.
    job = left.job.model_validate({**left.job.model_dump(), "pp": None, "dp": None,
                                   "global_batch": before.global_batch, "precision": before.precision,
                                   "tp": before.tp})
    left = replace(left, job=job)
    try:
        result = make_plan(left, top_k=top_k)
    except InfeasibleError as e:
        raise GeotrainError(f"no plan fits the cluster that is left: {e}") from None
    before_s = simulate(spec, before, iterations=1).metrics.iteration_time
    return Replan(spec, left, before, result.plan.with_(name=f"{before.name}-replan"), before_s,
                  result.iteration_s, spec_path, dropped)


def _shape(model) -> tuple:
    """What a checkpoint's tensors depend on (not the model's name)."""
    return tuple(getattr(model, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"))


def _layout(plan) -> str:
    return f"pp {plan.pp} x dp {plan.dp}" + (f" x tp {plan.tp}" if plan.tp > 1 else "")


def _stages(plan) -> str:
    return " | ".join(f"{st.dc} " + ",".join(f"{a}-{b - 1}" for a, b in st.chunks) for st in plan.stages)


def _links(plan) -> str:
    return "; ".join(f"{lp.src_dc}<->{lp.dst_dc} {lp.connections} conn {lp.sharing}" for lp in plan.links) or "none"


def _gpus(plan) -> str:
    return ", ".join(f"{dc} {n}" for dc, n in plan.gpus_per_dc().items())


def describe(r: Replan) -> list[str]:
    """The table of what changed, one line per aspect, and the iteration times."""
    rows = [("GPUs", _gpus), ("layout", _layout), ("stages (units)", _stages),
            ("micro-batching", lambda p: f"{p.micro_batch} x {p.num_microbatches}"),
            ("schedule", lambda p: p.schedule), ("sharding", lambda p: p.sharding),
            ("checkpointing", lambda p: p.checkpointing), ("links", _links)]
    width = max(len(_stages(r.before)), len(_links(r.before)), 20)
    out = [f"  {'':<16} {'before':<{width}}  after"]
    for label, fn in rows:
        a, b = fn(r.before), fn(r.after)
        out.append(f"  {label:<16} {a:<{width}}  {b}" + ("" if a != b else "   (same)"))

    def t(x: float) -> str:
        return human_seconds(x) if math.isfinite(x) else "n/a"

    ratio = r.after_s / r.before_s if r.before_s > 0 and math.isfinite(r.after_s) else math.nan
    out.append(f"  {'iteration':<16} {t(r.before_s) + ' (simulated)':<{width}}  {t(r.after_s)} (simulated), "
               f"{ratio:.2f}x the time")
    return out
