"""Job spec: what to train and with which techniques.

Fields set to "auto" are left for the planner to choose; a concrete value is a constraint.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from geotrain.config.base import Strict

Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective"]
Sharding = Literal["replicate", "zero1", "zero2", "zero3"]
ScheduleKind = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "wan-1f1b"]


class JobSpec(Strict):
    global_batch: PositiveInt = Field(description="sequences per optimizer step")
    micro_batch: PositiveInt | Literal["auto"] = "auto"
    precision: Precision = "bf16"
    checkpointing: Checkpointing | Literal["auto"] = "auto"
    sharding: Sharding | Literal["auto"] = "auto"
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    schedule: ScheduleKind | Literal["auto"] = "auto"
    tp: PositiveInt = 1
    # Optional fixed shape (otherwise chosen by the planner).
    pp: PositiveInt | None = None
    dp: PositiveInt | None = None
    # Training-run settings (used by `geotrain train`).
    steps: PositiveInt = 20
    lr: PositiveFloat = 3e-4
    seed: int = 0
    checkpoint_every: int = Field(0, ge=0)
    data: str | None = None

    @field_validator("sharding", mode="before")
    @classmethod
    def _fsdp_alias(cls, v: object) -> object:
        return "zero3" if v == "fsdp" else v

    @property
    def optimizer_state_slots(self) -> int:
        """fp32 tensors of optimizer state per parameter (Adam: m and v)."""
        return 0 if self.optimizer == "sgd" else 2
