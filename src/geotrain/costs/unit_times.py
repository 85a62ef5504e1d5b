"""Measured per-unit times that replace the peak-FLOP estimate.

A profile is a plain dict (so it can come from TOML or JSON):

    {
      "embedding": {"1": [forward_s, backward_s], "4": [forward_s, backward_s]},
      "block":     {"1": [...], "2": [...]},          # ONE block
      "head":      {"1": [...]},                       # final norm + head + cross-entropy
      "reference_gpu": {...GPUType fields...},         # optional: the GPU it was measured on
      "memory_bytes_per_s": 2.0e12,                    # optional: HBM bandwidth, for optimizer_time
      "runtime": {...},                                # optional, ignored here: what `geotrain profile`
    }                                                  # measured for the calibrated simulation

Keys of each unit table are micro-batch sizes (int or str). Times are seconds per micro-batch on
one GPU, measured at the job's precision, tensor-parallel degree 1 and WITHOUT checkpointing
(the cost model adds the recompute itself). A unit kind missing from the profile falls back to
the FLOP estimate. Sizes between measured ones are interpolated linearly; outside the measured
range time is scaled in proportion to the micro-batch from the nearest measured size. With
`reference_gpu`, times on another GPU type are scaled by the ratio of achieved FLOP/s.
"""

from __future__ import annotations

import bisect
from typing import Any

from geotrain.costs.units import KINDS
from geotrain.spec.cluster import GPUType

PROFILE_KEYS = set(KINDS) | {"reference_gpu", "memory_bytes_per_s"}
# Keys a profile file may carry for other readers: `geotrain profile` adds "runtime" (overheads the
# calibrated simulation in geotrain.calibrate.calibrated_costs uses), so CostModel(profile=json.load(f)) works on it.
IGNORED_KEYS = {"runtime", "format", "version"}


class Profile:
    def __init__(self, data: dict[str, Any]):
        unknown = set(data) - PROFILE_KEYS - IGNORED_KEYS
        if unknown:
            raise ValueError(f"unknown profile keys {sorted(unknown)} (known: {sorted(PROFILE_KEYS)})")
        self.tables: dict[str, tuple[list[int], list[tuple[float, float]]]] = {}
        for kind in KINDS:
            if kind not in data:
                continue
            rows = sorted((int(mb), (float(t[0]), float(t[1]))) for mb, t in data[kind].items())
            if not rows or any(mb < 1 or t[0] < 0 or t[1] < 0 for mb, t in rows):
                raise ValueError(f"profile[{kind!r}]: needs micro-batch sizes >= 1 and times >= 0")
            self.tables[kind] = ([mb for mb, _ in rows], [t for _, t in rows])
        ref = data.get("reference_gpu")
        self.reference_gpu = GPUType.model_validate(ref) if isinstance(ref, dict) else ref
        bw = data.get("memory_bytes_per_s")
        self.memory_bytes_per_s = float(bw) if bw is not None else None

    def has(self, kind: str) -> bool:
        return kind in self.tables

    def times(self, kind: str, micro_batch: int) -> tuple[float, float]:
        """(forward_s, backward_s) of one unit of `kind` at `micro_batch`, on the reference GPU."""
        mbs, ts = self.tables[kind]
        i = bisect.bisect_left(mbs, micro_batch)
        if i < len(mbs) and mbs[i] == micro_batch:
            return ts[i]
        if i == 0 or i == len(mbs):
            j = 0 if i == 0 else len(mbs) - 1
            r = micro_batch / mbs[j]
            return ts[j][0] * r, ts[j][1] * r
        a, b = mbs[i - 1], mbs[i]
        w = (micro_batch - a) / (b - a)
        return tuple(ts[i - 1][k] + w * (ts[i][k] - ts[i - 1][k]) for k in range(2))  # type: ignore[return-value]

    def speed_ratio(self, gpu: GPUType, precision: str) -> float:
        """Time on `gpu` / time on the reference GPU (1 when no reference was given)."""
        if self.reference_gpu is None:
            return 1.0
        return self.reference_gpu.achieved_flops(precision) / gpu.achieved_flops(precision)
