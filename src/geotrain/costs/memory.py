"""Memory per GPU: parameters, gradients, optimizer state and activations under each sharding."""

from __future__ import annotations

# Defined beside the job's precision and optimizer (the spec loader's fit check needs it); part of
# the memory model's vocabulary too.
from geotrain.spec.job import training_state_bytes_per_param  # noqa: F401

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

SHARDINGS = ("replicate", "zero1", "zero2", "zero3")
OPTIMIZERS = ("adamw", "adam", "sgd")


def optimizer_state_bytes_per_param(precision: str, optimizer: str) -> int:
    """Optimizer state: Adam's two fp32 moments (8 B), plus the fp32 master copy (4 B) when the
    weights themselves are held in a 16-bit dtype. SGD is plain (no momentum buffer)."""
    moments = 0 if optimizer == "sgd" else 8
    return moments + (0 if precision == "fp32" else 4)


def optimizer_step_bytes_per_param(precision: str, optimizer: str) -> int:
    """HBM bytes one optimizer step reads and writes per parameter (a fused, memory-bound kernel):
    read the gradient and every state tensor, write the state back and the (cast) weights.
    Adam mixed precision: read g(p) + master, m, v (12); write master, m, v (12) + weights (p).
    Adam fp32: read w, g, m, v (16); write w, m, v (12). SGD drops m and v."""
    p = DTYPE_BYTES[precision]
    state = optimizer_state_bytes_per_param(precision, optimizer)
    if precision == "fp32":
        return 4 + 4 + state + 4 + state  # read w, g, state; write w, state
    return p + state + state + p          # read g, state (incl. master); write state, weights


def sharded_fractions(sharding: str, dp: int) -> tuple[float, float, float]:
    """Fraction of (weights, gradients, optimizer state) one GPU keeps under a sharding level."""
    if sharding == "fsdp":
        sharding = "zero3"
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r} (known: {', '.join(SHARDINGS)})")
    level = SHARDINGS.index(sharding)
    s = 1.0 / dp
    return (s if level >= 3 else 1.0, s if level >= 2 else 1.0, s if level >= 1 else 1.0)


def runtime_state_bytes_per_param(precision: str, optimizer: str, sharding: str, dp: int) -> dict[str, float]:
    """Bytes per parameter that `geotrain.runtime` holds at a step's peak, per GPU.

    What the runtime does today (the planner's numbers must be the run's): weights stay fp32
    whatever the precision (autocast makes bf16/fp16 copies per micro-batch, counted with the
    activations), so do gradients, and Adam keeps two fp32 moments. ZeRO-1 partitions the
    optimizer state over dp; zero2/zero3 (FSDP2) shard the weights and keep them gathered from the
    forward (zero2: all of them at the peak) or the backward (zero3: at the peak, which comes at a
    backward's start, the root group -- embedding, head -- and the one block FSDP2 prefetched;
    `gathered` is per gathered parameter) until the gradients are reduced, and accumulate
    unsharded gradients over the micro-batches (no gradient sync until ALLREDUCE, like
    torch.distributed.pipelining), so at the peak a rank holds its shard, the gathered weights and
    the full gradients. In bf16, FSDP2's MixedPrecisionPolicy (`runtime.parallelize.
    fsdp_mixed_precision`) gathers the weights in bf16 and accumulates their unsharded gradients in
    bf16 (reduced in bf16, then kept as fp32 shards: `sharded_fractions`); the shards the
    optimizer updates -- the master weights -- stay fp32, and autocast makes no weight copies
    (`fsdp_weight_copies`)."""
    if precision not in DTYPE_BYTES:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(DTYPE_BYTES)})")
    if sharding == "fsdp":
        sharding = "zero3"
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r} (known: {', '.join(SHARDINGS)})")
    fsdp = sharding in ("zero2", "zero3")
    moments = 0 if optimizer == "sgd" else 8
    held = 2.0 if fsdp and precision == "bf16" else 4.0   # gathered weights and unsharded gradients
    return {"params": 4.0 / dp if fsdp else 4.0, "gathered": held if fsdp else 0.0, "grads": held,
            "optimizer": moments / dp if sharding != "replicate" else float(moments)}


def fsdp_gather_bytes_per_param(precision: str) -> int:
    """Bytes per parameter FSDP2 all-gathers: its MixedPrecisionPolicy's param_dtype
    (`runtime.parallelize.fsdp_mixed_precision`) -- bf16 under bf16; fp16 keeps param_dtype None
    (fp32 weights under autocast) and fp32 has no policy, so both gather the fp32 shards."""
    if precision not in DTYPE_BYTES:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(DTYPE_BYTES)})")
    return 2 if precision == "bf16" else 4


def fsdp_weight_copies(precision: str, sharding: str) -> bool:
    """Whether autocast copies the weights into the compute dtype per micro-batch: not when FSDP2
    already gathers them in bf16 (its MixedPrecisionPolicy), else whenever autocast is on."""
    return precision != "fp32" and not (precision == "bf16" and sharding in ("zero2", "zero3", "fsdp"))
