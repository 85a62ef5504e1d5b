"""`geotrain replan`: a new plan for what is left of a run's cluster, written and explained.

The search is `planner.replanning.replan`; this checks the request, writes the plan file (with the
simulated times before and after) and prints what changed and how to continue the run on it.
"""

from __future__ import annotations

from pathlib import Path

from geotrain.errors import GeotrainError
from geotrain.layout.plan import save_plan
from geotrain.planner.replanning import describe, replan


def replan_command(run_dir: str | Path, without: list[str], gpus: dict[str, int], spec: str | None,
                   top_k: int = 2, out: str | Path | None = None, say=print) -> Path:
    """Re-plan RUN_DIR without the `without` DCs, with `gpus` changed, or on `spec`'s cluster; write
    the plan (default RUN_DIR/replan.json) and return its path."""
    if top_k < 1:
        raise GeotrainError("--top-k must be >= 1")
    if not (without or gpus or spec):
        raise GeotrainError("say what changed: --without DC, --gpus DC=N or --spec NEW_SPEC")
    run_dir = Path(run_dir)
    r = replan(run_dir, without, gpus, spec, top_k=top_k)
    out = Path(out) if out else run_dir / "replan.json"
    save_plan(out, r.after, spec_path=r.spec_path, spec=r.spec_after,
              extra={"simulated_s": r.after_s, "replan": {"run": str(run_dir.resolve()), "dropped": r.dropped,
                                                          "gpus": r.after.gpus_per_dc(), "before_s": r.before_s}})
    gone = f" without {', '.join(r.dropped)}" if r.dropped else ""
    say(f"re-plan of {run_dir} ({r.spec_before.model.name}, global batch {r.before.global_batch}) for "
        f"{r.spec_after.cluster.name}{gone}:")
    for line in describe(r):
        say(line)
    say(f"wrote {out}; continue the run with:  geotrain train {out} --resume-from {run_dir} --out NEW_RUN_DIR")
    return out
