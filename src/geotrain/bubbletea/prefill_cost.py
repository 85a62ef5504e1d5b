"""How long a prefill takes on one GPU, and whether the inference model fits beside training.

Time of a prefill chunk of `n` new tokens after `p` tokens already in the KV cache:
    a + b * n + c * n * (2p + n)
so a whole prompt of length L, in any number of chunks k, costs k*a + b*L + c*L^2: the linear
term is the weight matmuls (2 * params FLOPs per token), the quadratic one causal attention,
and `a` the fixed cost of a launch. For planning the coefficients come from FLOPs; on a real
device they are fitted (least squares) to a short profile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from geotrain.models.presets import PRESETS
from geotrain.spec.cluster import GPUType
from geotrain.spec.model import ModelSpec

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class PrefillCost:
    a: float   # seconds per chunk (launch / fixed overhead)
    b: float   # seconds per token
    c: float   # seconds per token^2 (attention)

    def chunk_time(self, n: int, context: int = 0) -> float:
        return self.a + self.b * n + self.c * n * (2 * context + n)

    def prompt_time(self, lengths: Sequence[int]) -> float:
        """One batched prefill of several prompts: a + b * sum(L) + c * sum(L^2)."""
        return self.a + self.b * sum(lengths) + self.c * sum(n * n for n in lengths)

    def max_chunk(self, budget: float, context: int) -> int:
        """The most new tokens that fit in `budget` seconds after `context` cached tokens."""
        rest = budget - self.a
        if rest <= 0:
            return 0
        if self.c == 0:
            if self.b <= 0:
                return 1 << 30
            n = int(rest / self.b)
        else:  # c n^2 + (b + 2 c p) n - rest <= 0
            bb = self.b + 2 * self.c * context
            n = max(0, int((-bb + math.sqrt(bb * bb + 4 * self.c * rest)) / (2 * self.c)))
        # The closed form can land one off through rounding; settle it on chunk_time itself.
        while self.chunk_time(n + 1, context) <= budget:
            n += 1
        while n > 0 and self.chunk_time(n, context) > budget:
            n -= 1
        return n

    @classmethod
    def from_flops(cls, model: ModelSpec, gpu: GPUType, precision: str = "bf16",
                   launch_overhead_s: float = 2e-3) -> PrefillCost:
        rate = gpu.achieved_flops(precision)
        per_token = 2.0 * getattr(model, "shape", model).param_count()   # per matmul: a tied head still runs
        # Causal attention: QK^T and AV, 2 FLOPs per MAC, half the square: 2 * L * hidden * n^2.
        per_token_sq = 2.0 * model.layers * model.hidden
        return cls(a=launch_overhead_s, b=per_token / rate, c=per_token_sq / rate)

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[int], float]]) -> PrefillCost:
        """Least-squares fit of (a, b, c) to measured (prompt lengths, seconds) samples."""
        # lazy: numpy only when called (importers that never call it stay free of it)
        import numpy as np

        X = np.array([[1.0, float(sum(ls)), float(sum(n * n for n in ls))] for ls, _ in samples])
        y = np.array([t for _, t in samples])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        a, b, c = (max(0.0, float(v)) for v in coef)
        return cls(a, b, c)


def inference_memory_bytes(model: ModelSpec, max_tokens: int, precision: str = "bf16") -> float:
    """Weights + KV cache for `max_tokens` cached tokens + the activations of one chunk."""
    d = DTYPE_BYTES[precision]
    weights = model.param_count() * d
    kv = 2 * model.layers * model.kv_heads * model.head_dim * max_tokens * d
    act = max_tokens * (4 * model.hidden + 2 * model.ffn) * d + max_tokens * model.vocab * 4
    return weights + kv + act


def models_that_fit(headroom_bytes: float, max_tokens: int, candidates: dict[str, ModelSpec],
                    precision: str = "bf16") -> list[str]:
    return [name for name, m in candidates.items()
            if inference_memory_bytes(m, max_tokens, precision) <= headroom_bytes]


def free_beside_training(spec, plan, rank: int, used: float) -> float:
    """Bytes an inference model may use on `rank`'s GPU next to `used` bytes of training state;
    a TP group serves as one unit, so its members' free memory pools."""
    gpu = spec.cluster.gpu(spec.cluster.dc(plan.dc_of_rank(rank)).gpu_type)
    return (gpu.memory_bytes - used) * plan.tp


def headroom(spec, plan, peak_memory: dict[int, float]) -> tuple[float, list[str]]:
    """Memory left beside training on the tightest GPU (bytes, see free_beside_training), and
    the model presets whose prefill fits there with a full-length prompt."""
    room = min((free_beside_training(spec, plan, r, used) for r, used in peak_memory.items()), default=0.0)
    fit = [name for name, m in PRESETS.items() if inference_memory_bytes(m, m.seq_len) <= room]
    return room, fit
