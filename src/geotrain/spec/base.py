"""Shared pydantic base for every spec object.

* unknown keys are errors (a typo such as `capacity_gpbs` must not silently fall back to a default);
* strict types: TOML already has typed values, so `gpus = "8"` or `gpus = true` is a mistake worth
  reporting rather than coercing (ints are still accepted where a float is expected);
* no NaN/inf: TOML can spell them, but a bandwidth of `inf` would make every plan look free;
* objects are immutable once validated, so a checked spec cannot be made inconsistent later;
* every number is bounded by what makes physical sense (`bounded_int`, `bounded_float`): a GPU of
  1e300 TFLOP/s or a batch of 2**40 sequences is a typo, and let through it divides by zero,
  overflows or allocates without end further down;
* names that others refer to (datacenters, regions, experiments) are identifiers (`identifier`):
  ASCII letters, digits, `_ - .` -- so "east " or a Cyrillic "еast" is not a second "east", and a
  name never carries a control character into a log line, a file name or a network namespace.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


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


IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def identifier_problem(name: object) -> str | None:
    """Why `name` is not an identifier (see the module docstring), or None. The text is first
    NFC-normalised, so the message can tell a name that only differs by its Unicode form."""
    if not isinstance(name, str):
        return f"must be a string (got {type(name).__name__})"
    if IDENTIFIER.fullmatch(name):
        return None
    norm = unicodedata.normalize("NFC", name)
    shown = ascii(name) if len(name) <= 60 else ascii(name[:57]) + "..."
    if name != name.strip():
        why = "has leading or trailing white space"
    elif any(unicodedata.category(c).startswith("C") for c in norm):
        why = "has a control or invisible character"
    elif not norm.isascii():
        why = "has a non-ASCII character (one that can look like another)"
    elif len(name) > 64:
        why = "is longer than 64 characters"
    else:
        why = "may hold only letters, digits, '_', '-' and '.', and start with a letter or digit"
    return f"must be an identifier: {shown} {why}"


def _identifier(v: object) -> object:
    problem = identifier_problem(v) if isinstance(v, str) else None
    if problem:
        raise ValueError(problem)
    return v


# A name others refer to (a field type); non-strings are left to the str type's own error.
Identifier = Annotated[str, BeforeValidator(_identifier)]
