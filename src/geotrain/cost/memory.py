"""Memory per GPU: parameters, gradients, optimizer state and activations under each sharding."""

from __future__ import annotations

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def training_state_bytes_per_param(precision: str, optimizer: str) -> int:
    """Bytes of training state per parameter, before sharding and activations.

    Mixed precision (bf16/fp16) with Adam: 2 (weights) + 2 (grads) + 4 (fp32 master) + 8 (m, v)
    = 16 B. fp32 Adam: 4 + 4 + 8 = 16 B. SGD drops the 8 B of moments."""
    moments = 0 if optimizer == "sgd" else 8
    if precision == "fp32":
        return 4 + 4 + moments
    return 2 + 2 + 4 + moments
