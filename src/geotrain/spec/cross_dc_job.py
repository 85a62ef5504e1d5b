"""How a job crosses datacenters ([job] cross_dc, [job.diloco], boundary compression, the loss
cost it accepts): what `geotrain plan` compares and chooses among (planner.modes).

  cross_dc = "pipeline" -- pipeline stages across DCs, DP inside (Atlas; the default);
             "diloco"   -- DiLoCo: a worker per DC (or per group of near DCs: [job.diloco] workers),
                           each training its own replica, the outer pseudo-gradient exchanged every
                           H inner steps;
             "auto"     -- the fastest mode whose measured loss cost is accepted: at most
                           `max_loss_gap` (relative, e.g. 0.01 = 1 % above synchronous training's
                           final loss, planner.loss_table) or named in `cross_dc_allow`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from geotrain.spec.base import Strict

CrossDc = Literal["pipeline", "diloco", "auto"]
OuterCodec = Literal["fp32", "bf16", "int8", "int4"]
BoundaryCodec = Literal["none", "bf16", "fp8-e4m3", "fp8-e5m2", "int8"]


class DilocoSpec(Strict):
    """[job.diloco]: the outer loop (paper defaults: outer Nesterov SGD, lr 0.7, momentum 0.9)."""

    inner_steps: int = Field(32, ge=1, le=10**6)          # H
    fragments: int = Field(1, ge=1, le=1024)              # F: streaming DiLoCo when > 1
    overlap: int = Field(0, ge=0, le=10**6)               # inner steps an exchange runs beside
    mix: float = Field(0.5, ge=0, le=1)                   # with overlap: weight of the worker's own progress
    outer_lr: float = Field(0.7, gt=0, le=10)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    compression: OuterCodec = "fp32"
    connections: int = Field(4, ge=1, le=1024)             # TCP connections per cross-worker transfer
    workers: list[list[str]] | None = None                # groups of DCs, one worker each (None: the planner's)
    dead_after_s: float = Field(30.0, gt=0, le=86400)     # a worker silent this long is left behind
