"""Compute time per op, the way a GPU spends it: a roofline with a GEMM-shape efficiency curve.

Each op of a unit (the GEMMs, attention, norms and element-wise ops, the head's cross-entropy)
takes max(FLOPs / achievable FLOP/s, bytes / achieved memory bandwidth) + a launch. The
achievable FLOP/s of a GEMM (m x k) @ (k x n) is the plateau (`GPUType.efficiency` x peak) times
d / (d + GEMM_HALF_DIM) along n and k: narrow weights (a small hidden size, or n or k divided by
tp) fall off the plateau. Element-wise ops are memory-bound: bytes read and written / (HBM
bandwidth x `GPUType.memory_efficiency`). A pass (forward, or backward) takes at least its kernels
x the host's dispatch time per kernel (`GPUType.host_us`: eager PyTorch queues kernels no faster),
which is what makes a micro-batch of 1 dearer per sample than one of 4; the narrower GEMMs, that
floor and the TP all-reduces (priced apart, by costs.comm, in CostModel.tp_comm_time) make tp = 4
less than 4x faster than tp = 1.

Attention is priced as the runtime runs it: "fused" (geotrain's runtime: SDPA's flash or
memory-efficient kernel, causal blocks skipped, no s x s tensor in memory) or "materialized"
(Megatron's unfused path in the published GPU profiles: the scores written, the masked softmax
reads and writes them, all s x s per head; both models there have no attention dropout).

The constants are documented in docs/DECISIONS.md with their fit (bench/bench_planner.py
--calibration: per (micro-batch, tp) predicted vs the published per-layer profiles).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from geotrain.costs.activations import BLOCK, EMBEDDING, HEAD
from geotrain.models.shape import as_shape
from geotrain.spec.cluster import GPUType
from geotrain.spec.model import ModelSpec

# The weight dimension at which a GEMM reaches half its plateau along that axis, fitted with each
# GPU type's plateau, memory efficiency and host time to the 65 published per-layer points
# (OPT-350, GPT-Neo-2.7 on A100-40 and GH200: calibrate.roofline_fit, docs/DECISIONS.md); and
# the GPU-side gap each kernel costs beyond its work.
GEMM_HALF_DIM = 133.0
LAUNCH_S = 4e-6
ATTENTION = ("fused", "materialized")
# Passes over the s x s scores of materialized attention besides its GEMMs' own (forward,
# backward; the unfused mask, softmax and their gradients): fitted with the above to forward +
# backward totals, which do not tell the two apart -- all of it landed in the backward.
SCORE_PASSES = (0.0, 17.7)


@dataclass(frozen=True)
class Device:
    """What the roofline needs of a GPU at one precision."""

    peak_flops: float           # dense matmul FLOP/s
    efficiency: float           # the plateau fraction a large GEMM reaches
    memory_bytes_per_s: float   # achieved HBM bytes/s: the datasheet x GPUType.memory_efficiency
    launch_s: float = LAUNCH_S
    half_dim: float = GEMM_HALF_DIM
    host_s: float = 0.0         # the host's dispatch time per kernel: a pass takes at least kernels x this


def device_for(gpu: GPUType, precision: str, bandwidth: float) -> Device:
    """A GPU type at one precision; bandwidth: its HBM bytes/s (datasheet or measured)."""
    return Device(gpu.peak_flops(precision), gpu.efficiency, bandwidth * gpu.memory_efficiency,
                  host_s=gpu.host_us * 1e-6)


def gemm_efficiency(n: float, k: float, device: Device) -> float:
    """The fraction of peak a GEMM reaches: the plateau times d / (d + half_dim) along its weight's
    dimensions n and k (attention's: the sequence and head_dim). Not along m (tokens): per-sample
    time is flat from micro-batch 2 to 128 in the published profiles; what a micro-batch of 1 loses
    is the per-kernel cost spread over fewer samples."""
    h = device.half_dim
    return device.efficiency * (n / (n + h)) * (k / (k + h))


def gemm_s(m: float, n: float, k: float, device: Device, p: int, batch: float = 1.0) -> float:
    """One (batched) GEMM: max(FLOP-bound, memory-bound) + a launch. p: bytes per element."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    nbytes = p * (m * k + k * n + m * n) * batch
    return max(flops / (device.peak_flops * gemm_efficiency(n, k, device)),
               nbytes / device.memory_bytes_per_s) + device.launch_s


def memory_s(nbytes: float, device: Device, kernels: int = 1) -> float:
    """Element-wise work: its bytes at HBM bandwidth, and a launch per kernel."""
    return nbytes / device.memory_bytes_per_s + kernels * device.launch_s


def _linear(tokens: float, k_in: float, n_out: float, device: Device, p: int) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a linear layer y = x W, x: tokens x k_in."""
    return (gemm_s(tokens, n_out, k_in, device, p), gemm_s(tokens, k_in, n_out, device, p),
            gemm_s(k_in, n_out, tokens, device, p))


def _add(acc: tuple[float, float, float], op: tuple[float, float, float], times: float = 1.0):
    return tuple(a + times * x for a, x in zip(acc, op))


def block_seconds(spec: ModelSpec, micro_batch: int, tp: int, p: int, device: Device,
                  attention: str = "fused", ep: int = 1) -> tuple[float, float, float]:
    """(forward, backward_input, backward_weight) seconds of one block on one GPU of a tp group."""
    s = spec.seq_len
    T = micro_batch * s
    h, hd = spec.hidden, spec.head_dim
    heads, kv = spec.heads / tp, spec.kv_heads / tp
    q, kvw = heads * hd, kv * hd
    shape = as_shape(spec)
    f = b = w = 0.0
    for k_in, n_out in ((h, q + 2 * kvw), (q, h)):                       # q/k/v and output projections
        f, b, w = _add((f, b, w), _linear(T, k_in, n_out, device, p))
    if spec.experts:
        # each of the GPU's experts/ep experts runs a GEMM on the rows routed to it from its ep group
        # (T * k * ep / experts on average), its ffn split over tp; the router is one more GEMM
        # (grouped: one kernel per projection and direction for all of them)
        experts = spec.experts / ep
        rows, width = T * spec.experts_per_token * ep / spec.experts, spec.expert_ffn / tp
        f, b, w = _add((f, b, w), _linear(T, h, spec.experts, device, p))
        unlaunched = replace(device, launch_s=0.0)
        for k_in, n_out in ((h, 2 * width), (width, h)):
            f, b, w = _add((f, b, w), _linear(rows, k_in, n_out, unlaunched, p), experts)
            f, b, w = _add((f, b, w), (device.launch_s,) * 3)
        mlp_elems = experts * rows * width
        if spec.shared_expert_ffn:
            for k_in, n_out in ((h, 2 * spec.shared_expert_ffn / tp), (spec.shared_expert_ffn / tp, h)):
                f, b, w = _add((f, b, w), _linear(T, k_in, n_out, device, p))
            mlp_elems += T * spec.shared_expert_ffn / tp
    else:
        width = spec.ffn / tp
        for k_in, n_out in ((h, 2 * width), (width, h)):                 # gate and up (one GEMM), down
            f, b, w = _add((f, b, w), _linear(T, k_in, n_out, device, p))
        mlp_elems = T * width
    # attention: QK^T and PV per (sequence, head), batched
    groups = micro_batch * heads
    if attention == "fused":
        # flash: causal blocks skipped (half the pairs), q/k/v read and o written once
        pairs = 0.5
        io = p * T * (2 * q + 2 * kvw)
        fa = max(2 * 2.0 * groups * pairs * s * s * hd
                 / (device.peak_flops * gemm_efficiency(s, hd, device)), io / device.memory_bytes_per_s)
        f += fa + device.launch_s
        b += 2.5 * fa + 2 * device.launch_s        # dq, dk, dv and the recomputed scores
    elif attention == "materialized":
        f += gemm_s(s, s, hd, device, p, groups) + gemm_s(s, hd, s, device, p, groups)
        b += 2 * gemm_s(s, s, hd, device, p, groups) + 2 * gemm_s(s, hd, s, device, p, groups)
        scores = groups * s * s * p
        f += memory_s(SCORE_PASSES[0] * scores, device, 2)    # scale, mask and softmax: read, write
        b += memory_s(SCORE_PASSES[1] * scores, device, 2)    # its backward: gradient and output read, one written
    else:
        raise ValueError(f"unknown attention {attention!r} (known: {', '.join(ATTENTION)})")
    # element-wise: two norms and two residual adds on the hidden (whole on each TP rank), RoPE on
    # q and k, the MLP's activation and product on its rows
    hidden_bytes = p * T * h * (2 * 2 + 2 * 3)
    elementwise = hidden_bytes + p * T * (q + kvw) * 2 * shape.rotary_dim / hd + p * mlp_elems * 3
    f += memory_s(elementwise, device, 7)
    b += memory_s(2 * elementwise, device, 7)
    return f, b, w


def head_seconds(spec: ModelSpec, micro_batch: int, tp: int, p: int, device: Device) -> tuple[float, float, float]:
    """The final norm, the vocabulary projection (split over tp) and the cross-entropy (fp32 logits:
    log-softmax written, the loss read; in the backward the gradient of the logits written)."""
    T, h = micro_batch * spec.seq_len, spec.hidden
    v = spec.vocab / tp
    lf, lb, lw = _linear(T, h, v, device, p)
    logits = 4.0 * T * v
    return (lf + memory_s(p * T * h * 2 + 3 * logits, device, 3),
            lb + memory_s(p * T * h * 3 + 3 * logits, device, 3), lw)


def embedding_seconds(spec: ModelSpec, micro_batch: int, tp: int, p: int, device: Device) -> tuple[float, float, float]:
    """A gather of T rows (forward) and their scatter-add into the gradient (backward: weight work)."""
    rows = p * micro_batch * spec.seq_len * spec.hidden
    return memory_s(2 * rows, device), 0.0, memory_s(3 * rows, device)


_COUNTING = Device(float("inf"), 1.0, float("inf"), launch_s=1.0)   # every op takes 1 s: times are kernel counts


def host_floor(times: tuple[float, float, float], kernels: tuple[float, float, float],
               host_s: float) -> tuple[float, float, float]:
    """(forward, backward_input, backward_weight) no faster than the host queues their kernels: the
    forward at least its kernels x host_s, the backward (both parts, in proportion) likewise."""
    f, b, w = times
    f = max(f, kernels[0] * host_s)
    floor = (kernels[1] + kernels[2]) * host_s
    if b + w < floor:
        scale = floor / (b + w) if b + w > 0 else 0.0
        b, w = (b * scale, w * scale) if scale else (floor, 0.0)
    return f, b, w


def kind_seconds(spec: ModelSpec, micro_batch: int, tp: int, p: int, device: Device,
                 attention: str = "fused", ep: int = 1) -> dict[str, tuple[float, float, float]]:
    """Per unit kind, (forward, backward_input, backward_weight) seconds on one GPU of a tp group.
    A block at tp > 1 also queues its two all-reduces each way (their time is CostModel's)."""
    def kinds(d: Device) -> dict[str, tuple[float, float, float]]:
        return {EMBEDDING: embedding_seconds(spec, micro_batch, tp, p, d),
                BLOCK: block_seconds(spec, micro_batch, tp, p, d, attention, ep),
                HEAD: head_seconds(spec, micro_batch, tp, p, d)}

    out = kinds(device)
    if device.host_s <= 0:
        return out
    counts = kinds(_COUNTING)
    extra = 2.0 if tp > 1 else 0.0
    counts[BLOCK] = (counts[BLOCK][0] + extra, counts[BLOCK][1] + extra, counts[BLOCK][2])
    return {kind: host_floor(out[kind], counts[kind], device.host_s) for kind in out}
