"""Shared pydantic base: unknown keys are errors, objects are immutable once validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
