"""Shared pydantic base for every spec object.

* unknown keys are errors (a typo such as `capacity_gpbs` must not silently fall back to a default);
* strict types: TOML already has typed values, so `gpus = "8"` or `gpus = true` is a mistake worth
  reporting rather than coercing (ints are still accepted where a float is expected);
* no NaN/inf: TOML can spell them, but a bandwidth of `inf` would make every plan look free;
* objects are immutable once validated, so a checked spec cannot be made inconsistent later;
* every number is bounded by what makes physical sense (`bounded_int`, `bounded_float`): a GPU of
  1e300 TFLOP/s or a batch of 2**40 sequences is a typo, and let through it divides by zero,
  overflows or allocates without end further down.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def bounded_int(lo: int, hi: int):
    """An int in [lo, hi] (a field type); lo = 1 reads "greater than 0" as for any count."""
    return Annotated[int, Field(gt=0, le=hi) if lo == 1 else Field(ge=lo, le=hi)]


def bounded_float(lo: float, hi: float):
    """A finite float in [lo, hi] (a field type): "greater than 0" below zero, "at least lo" for
    a positive value too small to be physical (a 1e-300 TFLOP/s GPU would make times infinite)."""
    def floor(v: float) -> float:
        if v < lo:
            raise ValueError(f"must be at least {lo:g} (got {v:g})")
        return v
    return Annotated[float, Field(gt=0, le=hi), AfterValidator(floor)]
