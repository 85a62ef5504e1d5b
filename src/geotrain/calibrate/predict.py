"""Predict beside a finished run: the simulator's trace of the plan a run just executed.

The runtime only executes and measures; `geotrain train` calls this afterwards (on the launching
process, or under torchrun on the reporting rank, whose host holds the run directory) so
`geotrain report RUN_DIR` can put prediction and measurement side by side. With a `geotrain
profile` file the prediction uses the calibrated inputs of `calibrate.calibrated_costs` -- measured unit
times, runtime overheads, the WAN mode this run used -- else the plain cost model.
"""

from __future__ import annotations

import sys
from pathlib import Path

from geotrain.calibrate.calibrated_costs import predict
from geotrain.calibrate.profile_file import load_profile
from geotrain.sim import simulate

PREDICTED_NAME = "predicted_trace.jsonl"


def write_prediction(spec, plan, out: Path, profile: str | None = None, wan_mode: str = "off",
                     iterations: int = 3) -> Path | None:
    """Write OUT/predicted_trace.jsonl; None (and a note on stderr) if the prediction fails, which
    must never fail a training run that already finished."""
    try:
        if profile:
            result, details = predict(spec, plan, load_profile(profile), iterations=iterations, mode=wan_mode)
            result.trace.meta.update(calibrated={"profile": str(profile), "wan_mode": wan_mode,
                                                 "contention_factors": details["contention_factors"],
                                                 "background_runnable": details["background_runnable"]})
        else:
            result = simulate(spec, plan, iterations=iterations)
        path = Path(out) / PREDICTED_NAME
        result.trace.write_jsonl(path)
        return path
    except Exception as e:  # noqa: BLE001 -- a prediction failure must not fail a finished training run
        print(f"note: no simulator prediction written ({type(e).__name__}: {e})", file=sys.stderr)
        return None
