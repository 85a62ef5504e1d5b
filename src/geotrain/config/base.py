"""Shared pydantic base for every spec object.

* unknown keys are errors (a typo such as `capacity_gpbs` must not silently fall back to a default);
* strict types: TOML already has typed values, so `gpus = "8"` or `gpus = true` is a mistake worth
  reporting rather than coercing (ints are still accepted where a float is expected);
* no NaN/inf: TOML can spell them, but a bandwidth of `inf` would make every plan look free;
* objects are immutable once validated, so a checked spec cannot be made inconsistent later.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
