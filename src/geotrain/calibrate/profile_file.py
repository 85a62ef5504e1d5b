"""The profile file `geotrain profile` writes: what the simulator needs, measured on this machine.

The file is the cost model's profile format (geotrain.costs.unit_times: per-unit-kind forward and
backward seconds per micro-batch, `memory_bytes_per_s`) plus one extra key, "runtime", with what
the cost model has no field for but the calibrated simulation (costs.py) uses:

    "runtime": {
      "precision", "threads", "cores", "model", "micro_batches",
      "optimizer":  {"fixed_s", "per_param_s"},           # one optimizer step of a stage (fit)
      "allreduce":  {"2": {"alpha_s", "per_byte_s"}, ...}, # gloo all-reduce of dp ranks (fit)
      "p2p":        {"alpha_s", "per_byte_s"},             # gloo isend/irecv between two ranks
      "contention": {"1": 1.0, "2": f2, ...},              # compute slow-down when k ranks compute at once
      "background_runnable",                                  # other runnable threads meanwhile (cpuload.py)
      "per_action_s", "forward_call_s", "backward_call_s", # interpreter overheads (see _interpreter)
      "split_backward": {"input", "weight"},              # zero-bubble B_input, W over one backward
      "startup_s",                                         # one rank's process start-up (import torch ...)
      "compute_factor": {"forward", "backward", "optimizer", # in-runtime / isolated compute (calibration run)
                         "allreduce", "allreduce_first_stage", "allreduce_other_stages"},  # DP (dp = 2 run)
      "wan_message_overhead_s", "calibration_run",         # per-message WAN overhead, global all-reduce,
                                                           # wan_mode, rank_slowdown, background_effective
      "wan": {"per_connection_gbps", "aggregate_gbps", "latency_ms", "achieved_gbps": {"1": .., "4": ..}}
    }

The measuring is split by job: `timers` (one process: units, split backward, optimizer, start-up),
`overheads` (the runtime's interpreter on one rank), `pool` (several processes on the runtime's
launcher: contention, collectives, WAN), `calibration_run` (a real 2-stage pipeline), and `measure`
(`measure_profile`, the thin orchestrator of the four).

Why measure this way: each unit is timed as `geotrain.runtime` executes it -- a `UnitStack` of the
unit, fp32 weights under the precision's autocast, one CPU thread, float32 boundary tensors, the
last unit's loss through the runtime's own `lm_loss` -- so the numbers are the runtime's, not a
kernel benchmark's. Multi-process measurements run in one pool of spawned worker processes (one
start-up paid once); the pool is started only after the single-process timings, so nothing else
competes for the cores while those run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat, ValidationError

from geotrain.costs.unit_times import PROFILE_KEYS, Profile
from geotrain.errors import GeotrainError

RUNTIME_KEY = "runtime"
PROFILE_FORMAT, PROFILE_VERSION = "geotrain-profile", 1
# "MICRO_BATCH" or "MICRO_BATCH,TP" -> [forward_s, backward_s] or [forward_s, backward_s, activation_bytes]
# (costs.unit_times: what the keys and the optional third number mean)
UnitTable = dict[str, Annotated[list[NonNegativeFloat], Field(min_length=2, max_length=3)]]


class ProfileFile(BaseModel):
    """The file: format and version, the cost model's unit tables, and the runtime measurements
    (their many fields are read by calibrate.calibrated_costs, which checks what it uses)."""

    model_config = ConfigDict(extra="forbid")
    format: str
    version: int
    embedding: UnitTable = {}
    block: UnitTable
    head: UnitTable = {}
    memory_bytes_per_s: PositiveFloat | None = None
    reference_gpu: dict[str, Any] | None = None
    runtime: dict[str, Any] = {}
    source: str | None = None   # where an imported profile came from (calibrate.gpu_runs)


def save_profile(profile: dict[str, Any], path: str | Path) -> None:
    doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **profile}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_profile(path: str | Path) -> dict[str, Any]:
    """The profile in `path` (without its format and version), or a one-line GeotrainError for a
    missing, foreign, older or malformed file."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GeotrainError(f"{path}: profile file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GeotrainError(f"{path}: cannot read the profile ({e})") from None
    except json.JSONDecodeError as e:
        raise GeotrainError(f"{path}: not a JSON profile ({e})") from None
    if not isinstance(doc, dict) or ("format" not in doc and "block" not in doc):
        raise GeotrainError(f"{path}: not a geotrain profile (make one with `geotrain profile`)")
    if "format" not in doc:
        raise GeotrainError(f"{path}: a profile from an older geotrain (no format version); measure again with "
                            "`geotrain profile`")
    if doc.get("format") != PROFILE_FORMAT:
        raise GeotrainError(f"{path}: not a geotrain profile (format {doc.get('format')!r})")
    if doc.get("version") != PROFILE_VERSION:
        raise GeotrainError(f"{path}: profile version {doc.get('version')!r}; this geotrain reads version "
                            f"{PROFILE_VERSION} (measure again with `geotrain profile`)")
    try:
        ProfileFile.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise GeotrainError(f"{path}: {where}: {err['msg']}") from None
    profile = {k: v for k, v in doc.items() if k not in ("format", "version")}
    try:
        Profile(cost_profile(profile))   # the table keys and interpolation points (costs.unit_times)
    except ValueError as e:
        raise GeotrainError(f"{path}: {e}") from None
    return profile


def cost_profile(profile: dict[str, Any]) -> dict[str, Any]:
    """The part `CostModel(profile=...)` accepts (its format has no 'runtime' key)."""
    return {k: v for k, v in profile.items() if k in PROFILE_KEYS}
