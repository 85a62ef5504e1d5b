"""Job spec: what to train and with which techniques.

Fields set to "auto" are left for the planner to choose; a concrete value is a constraint.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from geotrain.spec.base import Strict, bounded_float, bounded_int
from geotrain.spec.cross_dc_job import BoundaryCodec, CrossDc, DilocoSpec

Precision = Literal["fp32", "bf16", "fp16"]
Checkpointing = Literal["none", "full", "selective", "keep-matmul", "keep-attention"]
Sharding = Literal["replicate", "zero1", "zero2", "zero3"]
ScheduleKind = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "wan-1f1b"]
# One flat Literal each (not `X | Literal["auto"]`): a flat Literal gives one clear error listing
# every allowed value, where a union would report one error per member.
CheckpointingOrAuto = Literal["none", "full", "selective", "keep-matmul", "keep-attention", "auto"]
ShardingOrAuto = Literal["replicate", "zero1", "zero2", "zero3", "auto"]
ScheduleOrAuto = Literal["gpipe", "1f1b", "interleaved", "zb-h1", "wan-1f1b", "auto"]


def training_state_bytes_per_param(precision: str, optimizer: str) -> int:
    """Bytes of training state per parameter, before sharding and activations.

    Mixed precision (bf16/fp16) with Adam: 2 (weights) + 2 (grads) + 4 (fp32 master) + 8 (m, v)
    = 16 B. fp32 Adam: 4 + 4 + 8 = 16 B. SGD drops the 8 B of moments. A fact of the job's
    precision and optimizer, kept here so the loader can refuse a model that cannot fit at all;
    the cost model (`costs.memory`) builds on it."""
    moments = 0 if optimizer == "sgd" else 8
    if precision == "fp32":
        return 4 + 4 + moments
    return 2 + 2 + 4 + moments


MAX_GLOBAL_BATCH = 2**16       # sequences per step: 65,536 x 4k tokens = 268M tokens, ~20x the largest LLM batches
MAX_MICRO_BATCH = 2**16
# Micro-batches per pipeline per step. Schedules, simulation and estimates hold per-micro-batch
# actions and events; past this count they would need gigabytes for a plan no one runs.
MAX_MICROBATCHES = 4096
# Names of the built-in streams `data` may give instead of a path.
DATA_BUILTINS = ("stdlib", "synthetic")


class DataSource(Strict):
    """One source of training text (`[[job.data]]`, or `data = { path = ... }`): a file or a folder
    in any format `geotrain.data.formats` reads, drawn in proportion to `weight` among the job's
    sources."""

    path: str = Field(min_length=1)
    weight: bounded_float(1e-9, 1e9) = 1.0
    # The record field (JSONL / JSON / Parquet / Arrow column) holding the text, or a chat's
    # list of {role, content} messages (rendered with the tokenizer's chat template).
    field: str = Field("text", min_length=1)
    split: str = Field("train", min_length=1)      # which split of a `datasets` DatasetDict folder



class JobSpec(Strict):
    global_batch: bounded_int(1, MAX_GLOBAL_BATCH) = Field(description="sequences per optimizer step")
    micro_batch: int | Literal["auto"] = "auto"
    precision: Precision = "bf16"
    checkpointing: CheckpointingOrAuto = "auto"
    sharding: ShardingOrAuto = "auto"
    optimizer: Literal["adamw", "adam", "sgd"] = "adamw"
    schedule: ScheduleOrAuto = "auto"
    tp: bounded_int(1, 1024) | Literal["auto"] = 1   # "auto": the planner searches it (per kind of DC)
    # Expert parallelism of a mixture of experts: ep replicas of a stage (inside its DC) split the
    # experts; "auto": the planner searches it (1 for a dense model).
    ep: bounded_int(1, 4096) | Literal["auto"] = "auto"
    # Optional fixed shape (otherwise chosen by the planner).
    pp: bounded_int(1, 100_000) | None = None
    dp: bounded_int(1, 10**7) | None = None
    # Training-run settings (used by `geotrain train`).
    steps: bounded_int(1, 10**9) = 20
    lr: bounded_float(1e-12, 10.0) = 3e-4
    # The recipe (runtime.recipe): the learning rate is a pure function of the optimizer step -- a
    # linear warm-up over `warmup_steps`, then `decay` from lr down to min_lr (or lr x min_lr_ratio)
    # at step `steps` (wsd: constant, then linear over the last `wsd_decay_fraction` of the steps
    # after warm-up); so a resumed or resharded run continues the same curve.
    warmup_steps: int = Field(0, ge=0, le=10**9)
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    wsd_decay_fraction: float = Field(0.2, gt=0, le=1)
    min_lr: float | None = Field(None, ge=0, le=10)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    # AdamW's decoupled weight decay (Adam / SGD: L2), on weight matrices only unless these say so.
    weight_decay: float = Field(0.1, ge=0, le=10)
    weight_decay_embeddings: bool = False
    weight_decay_norms: bool = False
    weight_decay_biases: bool = False
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2)
    eps: float = Field(1e-8, gt=0, le=1)
    grad_clip: float = Field(1.0, ge=0, le=1e6)     # the largest global gradient norm; 0: no clipping
    # Held-out loss every `eval_every` steps (0: never) over `eval_batches` global batches of a split
    # (`eval_split` of each source's windows) that training never reads.
    eval_every: int = Field(0, ge=0, le=10**9)
    eval_batches: int = Field(4, ge=1, le=10**6)
    eval_split: float = Field(0.01, gt=0, lt=0.5)
    seed: bounded_int(0, 2**63 - 1) = 0
    # Across datacenters (spec.cross_dc_job): the mode, DiLoCo's settings, compressed pipeline boundaries
    # (changes the numerics: off unless asked for), and the loss cost `cross_dc = "auto"` accepts.
    cross_dc: CrossDc = "pipeline"
    diloco: DilocoSpec = Field(default_factory=DilocoSpec)
    boundary_compression: BoundaryCodec = "none"
    boundary_rank: int = Field(0, ge=0, le=65536)
    max_loss_gap: float = Field(0.0, ge=0, le=10)
    cross_dc_allow: list[Literal["pipeline", "sync-dp", "hier-dp", "diloco", "streaming", "hybrid",
                                 "compressed"]] = Field(default_factory=list)
    loss_table: str | None = None          # a TOML of measured loss rows beside the built-in one
    checkpoint_every: int = Field(0, ge=0, le=10**9)
    # A path (file or folder), "stdlib" (the built-in corpus, the default) or "synthetic"; or one
    # table / a list of tables (DataSource) to set the field or mix sources with weights.
    data: list[DataSource] | str | None = None     # list first: its errors are the ones a table needs
    # A step whose loss is NaN or infinite: "stop" the run there (one-line error, nothing saved
    # after it) or "continue" (the step is logged with loss null). (fp16's skipped steps overflow
    # in their scaled gradients; their loss stays finite.)
    nan_policy: Literal["stop", "continue"] = "stop"

    @field_validator("data", mode="before")
    @classmethod
    def _data(cls, v: object) -> object:
        if isinstance(v, dict):                 # `data = { path = ... }`: one source
            return [v]
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if v is None or (isinstance(v, list) and v and all(isinstance(x, dict) for x in v)):
            return v
        raise ValueError('must be a path, "stdlib", "synthetic", a table or a list of tables '
                         f"([[job.data]] with path, weight, field, split); got {v!r:.60}")

    @property
    def data_sources(self) -> list[DataSource] | None:
        """The user's sources (None: a built-in stream, `data` None / "stdlib" / "synthetic")."""
        if self.data is None or self.data in DATA_BUILTINS:
            return None
        return [DataSource(path=self.data)] if isinstance(self.data, str) else list(self.data)

    @field_validator("sharding", mode="before")
    @classmethod
    def _fsdp_alias(cls, v: object) -> object:
        return "zero3" if v == "fsdp" else v

    @field_validator("pp", "dp", mode="before")
    @classmethod
    def _auto_shape(cls, v: object) -> object:
        return None if v == "auto" else v       # "auto", as for tp and micro_batch: the planner chooses

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch(cls, v: object) -> object:
        # Checked here so a bad value gets one message instead of one per union member.
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_MICRO_BATCH):
            return v
        raise ValueError(f'must be a positive integer or "auto", at most {MAX_MICRO_BATCH} (got {v!r:.40})')

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: list[float]) -> list[float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each must be in [0, 1) (got {v})")
        return v

    @model_validator(mode="after")
    def _check_recipe(self) -> JobSpec:
        if self.min_lr is not None and "min_lr_ratio" in self.model_fields_set:
            raise ValueError("min_lr: give min_lr or min_lr_ratio, not both")
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr: {self.min_lr:g} is above lr={self.lr:g}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps} is more than steps={self.steps}")
        return self

    @property
    def final_lr(self) -> float:
        """The learning rate the decay ends at."""
        return self.min_lr if self.min_lr is not None else self.lr * self.min_lr_ratio

    @model_validator(mode="after")
    def _check_batch(self) -> JobSpec:
        g = self.global_batch
        if isinstance(self.micro_batch, int):
            mb = self.micro_batch
            if mb > g:
                raise ValueError(f"micro_batch: {mb} is larger than global_batch={g}")
            if g % mb:
                raise ValueError(f"micro_batch: global_batch={g} is not a multiple of micro_batch={mb}")
        if self.dp is not None:
            per = self.dp * (self.micro_batch if isinstance(self.micro_batch, int) else 1)
            if g % per:
                what = f"dp={self.dp} x micro_batch={self.micro_batch}" if per != self.dp else f"dp={self.dp}"
                raise ValueError(f"dp: global_batch={g} is not a multiple of {what}")
        return self

    @property
    def optimizer_state_slots(self) -> int:
        """fp32 tensors of optimizer state per parameter (Adam: m and v)."""
        return 0 if self.optimizer == "sgd" else 2
