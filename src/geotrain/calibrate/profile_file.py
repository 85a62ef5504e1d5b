"""The profile file `geotrain profile` writes: what the simulator needs, measured on this machine.

The file is the cost model's profile format (`costs.unit_times`: per-unit-kind forward and
backward seconds per micro-batch) plus "runtime", what only the calibrated simulation uses; both
are typed below (`MeasuredProfile`, `RuntimeProfile`), whose fields say what each is. The
measuring is split by job -- `timers` (one process), `overheads` (one real rank), `pool` (several
processes: contention, collectives, WAN), `calibration_run` (a real 2-stage pipeline) -- and
`measure.measure_profile` runs them in that order, so nothing competes for the cores while the
single-process timings run. Each unit is timed as `geotrain.runtime` executes it (fp32 weights
under autocast, one thread, the runtime's `lm_loss`): the numbers are the runtime's, not a kernel
benchmark's.
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


class _Part(BaseModel):
    # Unknown keys are kept (a newer geotrain's measurement survives a load and save here).
    model_config = ConfigDict(extra="allow", frozen=True)


class Fit(_Part):
    alpha_s: float = 0.0            # seconds per message
    per_byte_s: float = 0.0


class OptimizerFit(_Part):
    fixed_s: float = 0.0            # one optimizer step of a stage: fixed + per parameter
    per_param_s: float = 0.0


class SplitBackward(_Part):
    input: float = 1.0              # zero-bubble B_input and W, as fractions of one backward
    weight: float = 1.0


class ComputeFactors(_Part):
    """In-runtime over isolated compute, from the calibration run (DP all-reduce: its dp = 2 run)."""

    forward: float = 1.0
    backward: float = 1.0
    optimizer: float = 1.0
    allreduce: float = 1.0
    allreduce_first_stage: float | None = None
    allreduce_other_stages: float | None = None

    def allreduce_at(self, stage: int) -> float:
        f = self.allreduce_first_stage if stage == 0 else self.allreduce_other_stages
        return self.allreduce if f is None else f


class WanMessages(_Part):
    overhead_s: dict[str, float] = {}   # per-message WAN overhead by link latency (ms, as text)
    gap_s: float = 0.0                  # back-to-back hand-off per message


class WanProbe(_Part):
    per_connection_gbps: float | None = None
    aggregate_gbps: float | None = None
    latency_ms: float | None = None
    achieved_gbps: dict[str, float] = {}   # connections -> achieved rate


class CalibrationRun(_Part):
    """The real 2-stage run the profile ends with (`calibration_run`): its conditions and what it measured."""

    wan_mode: str = "shaper"            # the runtime WAN it ran over (profiles made before modes: shaper)
    background_runnable: float | None = None    # other runnable threads meanwhile
    background_effective: float | None = None   # the background its ranks' measured CPU share implies
    sharing_residual: float | None = None       # what its ranks lost beyond processor sharing
    pool_residual: float | None = None          # a dp >= 2 run's compute beyond the core pool's
    allreduce_run: dict[str, Any] = {}          # its dp = 2 run (pool_residual there), or why skipped
    rank_slowdown: dict[int | str, float] = {}  # rank -> measured CPU-sharing slow-down
    global_sync_s: float | None = None          # the step-wide collective per step
    latency_ms: float | None = None             # its WAN link's latency
    ranks: int = 2
    measured_iteration_s: float | None = None


class RuntimeProfile(_Part):
    """What the cost model has no field for but the calibrated simulation (calibrated_costs) uses."""

    precision: str | None = None
    threads: int = 1                    # torch threads per rank while measuring
    cores: int = 0                      # the machine's cores
    model: str | None = None
    micro_batches: list[int] = []
    optimizer: OptimizerFit | None = None       # one optimizer step of a stage: fixed + per parameter
    allreduce: dict[str, Fit] = {}      # dp (as text) -> gloo all-reduce fit
    p2p: Fit | None = None              # gloo isend/irecv between two ranks
    contention: dict[int | str, float] = {}     # k ranks computing at once -> slow-down
    background_runnable: float = 0.0    # other runnable threads meanwhile (cpuload)
    per_action_s: float = 0.0           # the interpreter's own time per action (overheads)
    forward_call_s: float = 0.0
    backward_call_s: float = 0.0
    split_backward: SplitBackward | None = None     # zero-bubble B_input and W over one backward
    startup_s: float = 0.0              # one rank's process start-up (import torch ...)
    compute_factor: ComputeFactors = ComputeFactors()   # in-runtime over isolated compute, per kind
    wan_message_overhead_s: float = 0.0
    wan_messages: WanMessages | None = None     # the per-message overhead's probe over latency
    calibration_run: CalibrationRun = CalibrationRun()
    wan: WanProbe | None = None         # the link's measured rates and latency


class MeasuredProfile(_Part):
    """A profile, typed: the cost model's unit tables and the runtime's measurements. Readers take one
    (or the plain dict a measurement assembles: `of`); the file is `save_profile` / `load_profile`'s."""

    embedding: UnitTable = {}
    block: UnitTable = {}
    head: UnitTable = {}
    memory_bytes_per_s: PositiveFloat | None = None
    reference_gpu: dict[str, Any] | None = None
    runtime: RuntimeProfile = RuntimeProfile()
    source: str | None = None   # where an imported profile came from (calibrate.gpu_runs)

    @classmethod
    def of(cls, profile: MeasuredProfile | dict[str, Any]) -> MeasuredProfile:
        return profile if isinstance(profile, MeasuredProfile) else cls.model_validate(
            {k: v for k, v in profile.items() if k not in ("format", "version")})

    def as_dict(self) -> dict[str, Any]:
        """The plain data, as the file holds it (fields never set left out)."""
        return self.model_dump(mode="json", exclude_unset=True)

    def cost_tables(self) -> dict[str, Any]:
        """The part `CostModel(profile=...)` accepts (its format has no 'runtime' key)."""
        return cost_profile(self.as_dict())


class ProfileFile(MeasuredProfile):
    """The file: format and version around the profile."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: str
    version: int
    block: UnitTable


def save_profile(profile: MeasuredProfile | dict[str, Any], path: str | Path) -> None:
    data = profile.as_dict() if isinstance(profile, MeasuredProfile) else profile
    doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **data}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_profile(path: str | Path) -> MeasuredProfile:
    """The profile in `path`, typed, or a one-line GeotrainError for a missing, foreign, older or
    malformed file."""
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
        profile = MeasuredProfile.of(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise GeotrainError(f"{path}: {where}: {err['msg']}") from None
    try:
        Profile(profile.cost_tables())   # the table keys and interpolation points (costs.unit_times)
    except ValueError as e:
        raise GeotrainError(f"{path}: {e}") from None
    return profile


def cost_profile(profile: MeasuredProfile | dict[str, Any]) -> dict[str, Any]:
    """The part `CostModel(profile=...)` accepts (its format has no 'runtime' key)."""
    data = profile.as_dict() if isinstance(profile, MeasuredProfile) else profile
    return {k: v for k, v in data.items() if k in PROFILE_KEYS}


def as_dict(profile: MeasuredProfile | dict[str, Any]) -> dict[str, Any]:
    """A profile as plain data (what a measurement that adds to it works on)."""
    return profile.as_dict() if isinstance(profile, MeasuredProfile) else profile
