"""Measured per-unit times (and, optionally, saved bytes) that replace the peak-FLOP estimate.

A profile is a plain dict (so it can come from TOML or JSON):

    {
      "embedding": {"1": [forward_s, backward_s], "4": [forward_s, backward_s]},
      "block":     {"1": [...], "8,4": [forward_s, backward_s, activation_bytes]},   # ONE block
      "head":      {"1": [...]},                       # final norm + head + cross-entropy
      "reference_gpu": {...GPUType fields...},         # optional: the GPU it was measured on
      "memory_bytes_per_s": 2.0e12,                    # optional: HBM bandwidth, for optimizer_time
      "runtime": {...},                                # optional, ignored here: what `geotrain profile`
    }                                                  # measured for the calibrated simulation

Keys of each unit table are "MICRO_BATCH" (tensor-parallel degree 1) or "MICRO_BATCH,TP" (int keys
mean tp 1). Times are seconds per micro-batch on one GPU -- at tp > 1 one GPU of the TP group, the
layer's TP collectives included, as a profiler on that many GPUs measures them (Sailor's, imported by
`calibrate.gpu_runs`; `geotrain profile` measures tp 1) -- at the job's precision and WITHOUT
checkpointing (the cost model adds the recompute itself). The optional third number is the bytes one
micro-batch keeps for backward in that unit on one GPU; where a kind has it, the cost model takes it
instead of its derived activations (memory of a runtime whose saved tensors differ from geotrain's).
A unit kind missing from the profile falls back to the FLOP estimate.

Between measured points values are interpolated: linearly in the micro-batch at one tp, linearly in
1/tp between two measured tps (the ideal-scaling axis). Outside the measured range they are scaled
in proportion: to the micro-batch from the nearest measured size, by nearest_tp / tp from the nearest
measured tp (a tp-1-only profile is the old rule, time / tp). Only a kind measured at some tp > 1
carries its TP communication (`includes_tp_comm`); for the others the cost model adds it. With
`reference_gpu`, times on another GPU type are scaled by the ratio of achieved FLOP/s.
"""

from __future__ import annotations

import bisect
import json
from typing import Any

from geotrain.costs.units import KINDS
from geotrain.errors import SpecError
from geotrain.spec.cluster import GPUType

PROFILE_KEYS = set(KINDS) | {"reference_gpu", "memory_bytes_per_s"}
# Keys a profile file may carry for other readers: `geotrain profile` adds "runtime" (overheads the
# calibrated simulation in geotrain.calibrate.calibrated_costs uses), so CostModel(profile=json.load(f)) works on it.
IGNORED_KEYS = {"runtime", "format", "version", "source"}

Row = tuple[float, ...]   # (forward_s, backward_s) or (forward_s, backward_s, activation_bytes)


def table_key(micro_batch: int, tp: int = 1) -> str:
    """The unit-table key of a (micro-batch, tp) point: "8" at tp 1, "8,4" at tp 4."""
    return str(micro_batch) if tp == 1 else f"{micro_batch},{tp}"


def parse_key(key: Any) -> tuple[int, int]:
    """(micro_batch, tp) of a unit-table key: an int, "MICRO_BATCH" or "MICRO_BATCH,TP"."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key, 1
    parts = str(key).split(",")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        mb, tp = int(parts[0]), int(parts[1]) if len(parts) == 2 else 1
    except ValueError:
        raise ValueError(f"unit-table key {key!r}: expected MICRO_BATCH or MICRO_BATCH,TP (e.g. \"8\" or \"8,4\")") \
            from None
    if mb < 1 or tp < 1:
        raise ValueError(f"unit-table key {key!r}: micro-batch and tp must be >= 1")
    return mb, tp


def _lerp(a: Row, b: Row, w: float) -> Row:
    return tuple(x + w * (y - x) for x, y in zip(a, b))


def _scale(a: Row, r: float) -> Row:
    return tuple(x * r for x in a)


class _KindTable:
    """One unit kind's measured points: per tp, micro-batch sizes and their rows."""

    def __init__(self, kind: str, table: dict[Any, Any]):
        points: dict[int, dict[int, Row]] = {}
        widths = set()
        for key, row in table.items():
            mb, tp = parse_key(key)
            try:
                vals = tuple(float(x) for x in row)
            except (TypeError, ValueError):
                raise ValueError(f"profile[{kind!r}][{key!r}]: expected [forward_s, backward_s(, activation_bytes)]") \
                    from None
            if len(vals) not in (2, 3) or any(v < 0 or v != v for v in vals):
                raise ValueError(f"profile[{kind!r}][{key!r}]: expected 2 or 3 numbers >= 0 "
                                 "([forward_s, backward_s(, activation_bytes)])")
            if mb in points.setdefault(tp, {}):
                raise ValueError(f"profile[{kind!r}]: micro-batch {mb} at tp {tp} is given twice")
            points[tp][mb] = vals
            widths.add(len(vals))
        if not points:
            raise ValueError(f"profile[{kind!r}]: needs micro-batch sizes >= 1 and times >= 0")
        if len(widths) > 1:
            raise ValueError(f"profile[{kind!r}]: give activation bytes for every point of the kind or for none")
        self.has_bytes = widths == {3}
        self.tps = sorted(points)
        self.rows = {tp: (sorted(p), [p[m] for m in sorted(p)]) for tp, p in points.items()}

    def _at_tp(self, tp: int, micro_batch: int) -> Row:
        mbs, rows = self.rows[tp]
        i = bisect.bisect_left(mbs, micro_batch)
        if i < len(mbs) and mbs[i] == micro_batch:
            return rows[i]
        if i == 0 or i == len(mbs):
            j = 0 if i == 0 else len(mbs) - 1
            return _scale(rows[j], micro_batch / mbs[j])
        a, b = mbs[i - 1], mbs[i]
        return _lerp(rows[i - 1], rows[i], (micro_batch - a) / (b - a))

    def value(self, micro_batch: int, tp: int) -> Row:
        tps = self.tps
        i = bisect.bisect_left(tps, tp)
        if i < len(tps) and tps[i] == tp:
            return self._at_tp(tp, micro_batch)
        if i == 0 or i == len(tps):
            n = tps[0] if i == 0 else tps[-1]
            return _scale(self._at_tp(n, micro_batch), n / tp)
        a, b = tps[i - 1], tps[i]
        return _lerp(self._at_tp(a, micro_batch), self._at_tp(b, micro_batch), (1 / tp - 1 / a) / (1 / b - 1 / a))


class Profile:
    def __init__(self, data: dict[str, Any]):
        unknown = set(data) - PROFILE_KEYS - IGNORED_KEYS
        if unknown:
            raise ValueError(f"unknown profile keys {sorted(unknown)} (known: {sorted(PROFILE_KEYS)})")
        self.tables: dict[str, _KindTable] = {}
        for kind in KINDS:
            if kind not in data:
                continue
            if not isinstance(data[kind], dict):
                raise ValueError(f"profile[{kind!r}]: expected a table of micro-batch sizes")
            self.tables[kind] = _KindTable(kind, data[kind])
        ref = data.get("reference_gpu")
        self.reference_gpu = GPUType.model_validate(ref) if isinstance(ref, dict) else ref
        bw = data.get("memory_bytes_per_s")
        self.memory_bytes_per_s = float(bw) if bw is not None else None

    def has(self, kind: str) -> bool:
        return kind in self.tables

    def times(self, kind: str, micro_batch: int, tp: int = 1) -> tuple[float, float]:
        """(forward_s, backward_s) of one unit of `kind` at `micro_batch` on one GPU of a `tp`-way
        group, on the reference GPU (see the module docstring for the interpolation)."""
        row = self.tables[kind].value(micro_batch, tp)
        return row[0], row[1]

    def includes_tp_comm(self, kind: str, tp: int) -> bool:
        """Whether `times(kind, ., tp)` already holds the TP collectives: measured at some tp > 1."""
        return tp > 1 and kind in self.tables and self.tables[kind].tps[-1] > 1

    def activation_bytes(self, kind: str, micro_batch: int, tp: int = 1) -> float | None:
        """Measured bytes one micro-batch keeps for backward in one unit of `kind` on one GPU, or
        None where the profile has none for that kind."""
        t = self.tables.get(kind)
        if t is None or not t.has_bytes:
            return None
        return t.value(micro_batch, tp)[2]

    def speed_ratio(self, gpu: GPUType, precision: str) -> float:
        """Time on `gpu` / time on the reference GPU (1 when no reference was given)."""
        if self.reference_gpu is None:
            return 1.0
        return self.reference_gpu.achieved_flops(precision) / gpu.achieved_flops(precision)


def read_unit_profile(path: str) -> dict[str, Any]:
    """A profile file (`geotrain profile`'s, or this format), checked: a SpecError naming the file otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise SpecError(path, "", f"cannot read profile: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise SpecError(path, "", f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise SpecError(path, "", "a profile must be a JSON object")
    try:
        Profile(data)
    except ValueError as e:
        raise SpecError(path, "profile", str(e)) from None
    return data
