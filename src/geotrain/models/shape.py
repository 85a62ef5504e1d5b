"""The shape of a decoder: what the model needs to be built, and nothing else.

Owned by `models` (the model is built from it) and built by `config` from validated TOML
(`ModelSpec.shape`), so the torch model never sees a spec and the spec never sees torch.
The per-shape arithmetic (head size, cuttable units, parameter count) lives here once.

One decoder (`models.llama`) with switches covers the families people train today: every switch
below is a difference in the math between Llama, Mistral, Qwen2/3, Gemma, Phi-3 and the
mixture-of-experts families (Mixtral, Qwen2/3-MoE); `family` only says which Hugging Face
`model_type` the weights are named and exported as (`models.families`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# rope_scaling keys per rope_type: (required, optional). transformers' ROPE_INIT_FUNCTIONS.
ROPE_TYPES: dict[str, tuple[set[str], set[str]]] = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim", "truncate"}),
    "longrope": ({"long_factor", "short_factor"}, {"factor", "original_max_position_embeddings",
                                                   "attention_factor"}),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor"}, {"original_max_position_embeddings"}),
}
ACTIVATIONS = ("silu", "gelu_tanh")


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    family: str = "llama"            # the HF model_type the weights are named and exported as
    head_size: int = 0               # an explicit head_dim (Qwen3, Gemma); 0: hidden // heads
    max_positions: int = 0           # the HF config's max_position_embeddings; 0: seq_len
    rope_scaling: Any = ()           # rope_type and its parameters ((key, value) pairs); (): plain RoPE
    partial_rotary: float = 1.0      # the fraction of each head RoPE rotates (Phi-3)
    qkv_bias: bool = False           # q, k, v projections have biases (Qwen2; Llama's attention_bias)
    out_bias: bool = False           # the attention output projection has one (Llama's attention_bias)
    mlp_bias: bool = False           # gate, up and down projections have biases
    qk_norm: bool = False            # RMSNorm over each head's q and k before RoPE (Qwen3)
    sliding_window: int = 0          # each query sees this many keys, itself included; 0: all before it
    act: str = "silu"                # the MLP's gate activation: silu, or gelu_tanh (Gemma)
    norm_offset: bool = False        # norms scale by (1 + w), in fp32, w starting at 0 (Gemma)
    embed_scale: bool = False        # embeddings multiplied by sqrt(hidden) (Gemma)
    experts: int = 0                 # routed experts per block (mixture of experts); 0: a dense MLP
    experts_per_token: int = 0       # top-k
    expert_ffn: int = 0              # each expert's intermediate size
    shared_expert_ffn: int = 0       # an always-on expert beside the routed ones, sigmoid-gated (Qwen2-MoE)
    norm_topk: bool = True           # the top-k routing weights renormalised to sum to 1 (Mixtral)
    router_aux_coef: float = 0.0     # weight of the load-balancing loss (Switch Transformer's, per layer)

    def __post_init__(self) -> None:
        rope = self.rope_scaling
        if isinstance(rope, dict):
            rope = rope.items()
        object.__setattr__(self, "rope_scaling", tuple(sorted((str(k), _frozen(v)) for k, v in (rope or ()))))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def positions(self) -> int:
        """max_position_embeddings: the positions the RoPE scaling was made for."""
        return self.max_positions or self.seq_len

    @property
    def rope(self) -> dict[str, Any]:
        """rope_scaling as a dict, with "rope_type" always present."""
        d = dict(self.rope_scaling)
        d.setdefault("rope_type", "default")
        return d

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def num_units(self) -> int:
        """Pipeline-cuttable units: embedding, `layers` blocks, then final norm + head."""
        return self.layers + 2

    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = 2 * h * q + 2 * h * kv                        # wq, wo; wk, wv
        n += (q + 2 * kv) * self.qkv_bias + h * self.out_bias
        return n + 2 * self.head_dim * self.qk_norm

    def mlp_params(self) -> int:
        """The MLP of one block: dense (gate, up, down), or the router, every expert and the shared one."""
        h = self.hidden
        if not self.moe:
            return 3 * h * self.ffn + (2 * self.ffn + h) * self.mlp_bias
        shared = 3 * h * self.shared_expert_ffn + h if self.shared_expert_ffn else 0
        return self.experts * h + self.experts * 3 * h * self.expert_ffn + shared

    def block_params(self) -> int:
        return self.attention_params() + self.mlp_params() + 2 * self.hidden   # + the two norms

    def param_count(self) -> int:
        h, v = self.hidden, self.vocab
        return v * h + self.layers * self.block_params() + h + h * v  # embedding + blocks + final norm + head

    def active_param_count(self) -> int:
        """Parameters one token computes with: of the experts only the top-k (all of a dense model)."""
        if not self.moe:
            return self.param_count()
        idle = (self.experts - self.experts_per_token) * 3 * self.hidden * self.expert_ffn
        return self.param_count() - self.layers * idle

    def fields_dict(self) -> dict[str, Any]:
        """The fields as plain data (rope_scaling a dict, its lists lists): what a spec validates."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling} or None
        return out


def as_shape(spec) -> ModelShape:
    """A ModelShape from itself or from anything carrying one (a validated ModelSpec's `.shape`)."""
    return spec if isinstance(spec, ModelShape) else spec.shape


def shape_problem(s: ModelShape) -> tuple[str, str] | None:
    """(field, reason) for a shape the decoder cannot compute, else None (torch-free: specs use it)."""
    if s.head_size == 0 and s.hidden % s.heads:
        return "hidden", f"{s.hidden} is not divisible by heads={s.heads} (or give head_size)"
    if s.heads % s.kv_heads:
        return "kv_heads", f"heads={s.heads} is not divisible by kv_heads={s.kv_heads}"
    if not 0 < s.partial_rotary <= 1:
        return "partial_rotary", f"must be in (0, 1] (got {s.partial_rotary})"
    if s.rotary_dim % 2 or s.rotary_dim == 0:
        return "hidden", f"the rotated part of a head ({s.rotary_dim} of head_dim {s.head_dim}) must be even"
    if s.max_positions and s.seq_len > s.max_positions:
        return "seq_len", f"{s.seq_len} is past max_positions {s.max_positions}"
    if s.act not in ACTIVATIONS:
        return "act", f"must be one of {', '.join(ACTIVATIONS)} (got {s.act!r})"
    if s.moe:
        if not 1 <= s.experts_per_token <= s.experts:
            return "experts_per_token", f"must be in 1..experts={s.experts} (got {s.experts_per_token})"
        if s.expert_ffn < 1:
            return "expert_ffn", "a mixture of experts needs each expert's intermediate size"
    elif s.experts_per_token or s.shared_expert_ffn or s.expert_ffn:
        return "experts", "experts_per_token, expert_ffn and shared_expert_ffn need experts > 0"
    return rope_problem(s)


def rope_problem(s: ModelShape) -> tuple[str, str] | None:
    rope = s.rope
    kind = rope.pop("rope_type")
    if kind not in ROPE_TYPES:
        return "rope_scaling.rope_type", f"{kind!r} is not one of {', '.join(ROPE_TYPES)}"
    required, optional = ROPE_TYPES[kind]
    for key in sorted(required - set(rope)):
        return f"rope_scaling.{key}", f"rope_type {kind!r} needs it"
    for key in sorted(set(rope) - required - optional):
        return f"rope_scaling.{key}", f"not a parameter of rope_type {kind!r}"
    for key, value in rope.items():
        values = value if isinstance(value, tuple) else (value,)
        if key == "truncate":
            if not isinstance(value, bool):
                return f"rope_scaling.{key}", f"must be true or false (got {value!r})"
            continue
        least = 0 if key.startswith("mscale") else 1e-12
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                 and v >= least for v in values):
            return f"rope_scaling.{key}", f"must be a positive number{'s' if key.endswith('_factor') else ''}"
        if key in ("long_factor", "short_factor"):
            if not isinstance(value, tuple) or len(value) != s.rotary_dim // 2:
                return f"rope_scaling.{key}", f"must list rotary_dim / 2 = {s.rotary_dim // 2} numbers"
        elif isinstance(value, tuple):
            return f"rope_scaling.{key}", "must be a number"
    if kind == "llama3" and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        return "rope_scaling.high_freq_factor", "must be above low_freq_factor"
    return None
