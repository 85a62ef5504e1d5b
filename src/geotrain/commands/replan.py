"""geotrain replan RUN_DIR: a new plan for the cluster that is left after losing a DC or GPUs.

The run's own plan and spec say what was trained (model, global batch, precision, optimizer);
the cluster is cut down (`--without DC`, `--gpus DC=N`) or replaced (`--spec NEW_SPEC`), the
job's pinned pp and dp are released -- they described the cluster that is gone -- and the
planner searches again. Both plans are simulated so the change in iteration time is a
prediction of the same kind. `geotrain train NEW_PLAN --resume-from RUN_DIR` then continues
the run's last checkpoint on the new layout.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

HELP = "re-plan a run for the cluster left after losing datacenters or GPUs (then train --resume-from)"
ORDER = 55
DESCRIPTION = ("Write a new plan for RUN_DIR's model, global batch and optimizer on what is left of its cluster, "
               "print what changed and the simulated iteration time before and after.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `geotrain train` run directory (its plan.json)")
    p.add_argument("--without", action="append", default=[], metavar="DC", help="drop this datacenter (repeatable)")
    p.add_argument("--gpus", action="append", default=[], metavar="DC=N",
                   help="this datacenter now has N GPUs (repeatable; 0 drops it)")
    p.add_argument("--spec", default=None, metavar="NEW_SPEC",
                   help="take the cluster from this experiment file (same model and global batch)")
    p.add_argument("--out", default=None, metavar="PLAN.json", help="where to write the plan (RUN_DIR/replan.json)")
    p.add_argument("--top-k", type=int, default=2, metavar="K", help="plans confirmed by simulation (default 2)")


@dataclass
class Replan:
    """The plan before and after, each with its simulated iteration time (seconds)."""

    spec_before: object
    spec_after: object
    before: object                      # Plan
    after: object                       # Plan
    before_s: float
    after_s: float
    spec_path: str
    dropped: list[str] = field(default_factory=list)


def run_plan(run_dir: Path):
    """(plan, spec path) a run was trained with, from RUN_DIR/plan.json."""
    from geotrain.errors import GeotrainError
    from geotrain.plan.plan import load_plan

    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        raise GeotrainError(f"{run_dir}: no plan.json (not a `geotrain train` run directory)")
    plan, doc = load_plan(path)
    if not doc.get("spec"):
        raise GeotrainError(f"{path}: the plan does not name the experiment spec it was trained with")
    return plan, str(doc["spec"])


def parse_gpus(items: list[str]) -> dict[str, int]:
    from geotrain.errors import GeotrainError

    out = {}
    for item in items:
        name, sep, n = item.partition("=")
        if not sep or not name or not n.strip().isdigit():
            raise GeotrainError(f"--gpus expects DC=N with N a whole number >= 0 (got {item!r})")
        out[name.strip()] = int(n)
    return out


def cluster_left(spec, without: list[str], gpus: dict[str, int]):
    """`spec` with the named DCs (and their WAN links) gone and GPU counts changed."""
    from geotrain.errors import GeotrainError

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
    from geotrain.config.load import load_spec
    from geotrain.errors import GeotrainError, InfeasibleError
    from geotrain.plan.search import make_plan
    from geotrain.sim import simulate

    before, spec_path = run_plan(Path(run_dir))
    spec = load_spec(spec_path)
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
    from geotrain.console import human_seconds

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


def run(args: argparse.Namespace) -> int:
    from geotrain.errors import GeotrainError
    from geotrain.plan.plan import save_plan

    if args.top_k < 1:
        raise GeotrainError("--top-k must be >= 1")
    if not (args.without or args.gpus or args.spec):
        raise GeotrainError("say what changed: --without DC, --gpus DC=N or --spec NEW_SPEC")
    run_dir = Path(args.run_dir)
    r = replan(run_dir, args.without, parse_gpus(args.gpus), args.spec, top_k=args.top_k)
    out = Path(args.out) if args.out else run_dir / "replan.json"
    save_plan(out, r.after, spec_path=r.spec_path,
              extra={"simulated_s": r.after_s, "replan": {"run": str(run_dir.resolve()), "dropped": r.dropped,
                                                          "gpus": r.after.gpus_per_dc(), "before_s": r.before_s}})
    gone = f" without {', '.join(r.dropped)}" if r.dropped else ""
    print(f"re-plan of {run_dir} ({r.spec_before.model.name}, global batch {r.before.global_batch}) for "
          f"{r.spec_after.cluster.name}{gone}:")
    for line in describe(r):
        print(line)
    print(f"wrote {out}; continue the run with:  geotrain train {out} --resume-from {run_dir} --out NEW_RUN_DIR")
    return 0
