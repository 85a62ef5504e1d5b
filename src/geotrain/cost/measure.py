"""Measure a profile (see profile.py): per-unit forward/backward seconds of the real model.

One unit of each kind (embedding, one block, head + cross-entropy) is built alone, in the
training dtype, on `device`, and timed for each micro-batch size: the median of `repeats` runs
after one warm-up. Building a single block keeps this cheap even for large shapes (a 70B block is
~1.7 GB in bf16), so a profile for a big model can be taken on one GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

from geotrain.config.model import ModelSpec
from geotrain.cost.units import BLOCK, EMBEDDING, HEAD

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def measure_profile(spec: ModelSpec, micro_batches: Iterable[int] = (1,), precision: str = "fp32",
                    repeats: int = 3, device: str = "cpu") -> dict[str, Any]:
    """Return {"embedding"|"block"|"head": {str(micro_batch): [forward_s, backward_s]}}."""
    import torch
    import torch.nn.functional as F

    from geotrain.models.llama import build_unit

    dtype = getattr(torch, TORCH_DTYPES[precision])
    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for kind, index in ((EMBEDDING, 0), (BLOCK, 1), (HEAD, spec.layers + 1)):
        unit = build_unit(spec, index).to(device=dev, dtype=dtype)
        table = {}
        for mb in micro_batches:
            shape = (mb, spec.seq_len)
            tokens = torch.randint(0, spec.vocab, shape, generator=g).to(dev)
            x = torch.randn(*shape, spec.hidden, generator=g).to(device=dev, dtype=dtype)

            def forward(unit=unit, kind=kind, tokens=tokens, x=x):
                if kind == EMBEDDING:
                    return unit(tokens)
                y = unit(x.requires_grad_())
                return F.cross_entropy(y.flatten(0, 1), tokens.flatten()) if kind == HEAD else y

            fwd, bwd = [], []
            for i in range(repeats + 1):
                unit.zero_grad(set_to_none=True)
                sync()
                t0 = time.perf_counter()
                y = forward()
                sync()
                t1 = time.perf_counter()
                y.backward(None if y.dim() == 0 else torch.ones_like(y))
                sync()
                t2 = time.perf_counter()
                x.grad = None
                if i:  # the first run warms caches and kernels up
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
            table[str(mb)] = [statistics.median(fwd), statistics.median(bwd)]
        out[kind] = table
    return out
