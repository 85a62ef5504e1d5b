"""The cost model: time, bytes and memory of model units and pipeline stages.

The planner calls `stage_times` / `stage_memory` for hundreds of thousands of candidate stages, so
everything is precomputed per unit *kind* (embedding, block, head; all blocks are identical) and a
stage reduces to (has embedding, number of blocks, has head): each query is a handful of
multiply-adds, whatever the stage's length -- the closed form of a prefix sum over units.

What each number means, and the conventions behind it, are documented in `units.py` (FLOPs,
saved bytes), `memory.py` (training state), `comm.py` (collectives) and `unit_times.py` (measured
times). Times are compute only: the caller adds tensor-parallel communication (`tp_comm_time`)
and WAN transfers where its schedule exposes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from geotrain.costs import comm, roofline
from geotrain.costs.activations import SELECTIVE, deferred_weight_bytes, mlp_rows, rope_table_bytes, stage_input_bytes
from geotrain.costs.experts import block_params_per_gpu, moe_comm_time, replicated_expert_params
from geotrain.costs.memory import (
    DTYPE_BYTES,
    OPTIMIZERS,
    fsdp_gather_bytes_per_param,
    fsdp_weight_copies,
    optimizer_state_bytes_per_param,
    optimizer_step_bytes_per_param,
    runtime_state_bytes_per_param,
    sharded_fractions,
)
from geotrain.costs.unit_times import Profile
from geotrain.costs.units import (
    BLOCK,
    CHECKPOINTING,
    EMBEDDING,
    HEAD,
    KINDS,
    kind_activations,
    kind_flops,
    kind_params,
    recompute_share,
    unit_kind,
)
from geotrain.spec.cluster import Datacenter, GPUType
from geotrain.spec.model import ModelSpec

# A GPU type without memory_tbps: HBM bytes/s = bf16 peak FLOP/s / this (A100 156, H100 SXM 295).
MACHINE_BALANCE_FLOP_PER_BYTE = 200.0


@dataclass(frozen=True)
class StageTimes:
    """Seconds per micro-batch on one GPU of the stage (compute only)."""

    forward: float
    backward: float          # backward_input + backward_weight (recompute included)
    backward_input: float    # zero-bubble "B": input gradients, plus any checkpointing recompute
    backward_weight: float   # zero-bubble "W": weight gradients


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    transient: float = 0.0   # working set at the peak: logits and their gradients, a recomputed block
    data: float = 0.0        # the step's token ids and targets

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.activations + self.buffers + self.transient
                + self.data)


class CostModel:
    def __init__(self, model: ModelSpec, precision: str = "bf16", checkpointing: str = "none",
                 optimizer: str = "adamw", profile: dict[str, Any] | None = None, ep: int = 1):
        if precision not in DTYPE_BYTES:
            raise ValueError(f"unknown precision {precision!r} (known: {', '.join(DTYPE_BYTES)})")
        if checkpointing not in CHECKPOINTING:
            raise ValueError(f"unknown checkpointing {checkpointing!r} (known: {', '.join(CHECKPOINTING)})")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})")
        self.model, self.precision, self.checkpointing, self.optimizer = model, precision, checkpointing, optimizer
        self.profile = Profile(profile) if profile is not None else None
        self._profile_doc = profile
        self._variants: dict[str, CostModel] = {}
        self.dtype_bytes = DTYPE_BYTES[precision]
        self._head = model.layers + 1
        params = kind_params(model)
        params[BLOCK] = block_params_per_gpu(model, params[BLOCK], ep)   # ep > 1: 1/ep of the experts (experts.py)
        self._params, self.ep = tuple(params[k] for k in KINDS), ep   # (embedding, block, head) per GPU
        self._mlp_rows, self._rope_bytes = mlp_rows(model), rope_table_bytes(model)
        # Tied embeddings: a stage holding both ends holds the matrix once (one Parameter); a
        # pipeline's first and last stage each hold a copy (counted with each: `runtime.tied`).
        self._tied = model.vocab * model.hidden if getattr(model, "tie_embeddings", False) else 0
        self._state_bytes = optimizer_state_bytes_per_param(precision, optimizer)
        self._step_bytes = optimizer_step_bytes_per_param(precision, optimizer)
        self._flops: dict[int, dict] = {}
        self._acts: dict[tuple[int, int], tuple[float, float, float, float]] = {}
        self._deferred: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._times: dict[tuple[int, int], tuple[GPUType, tuple]] = {}

    def with_checkpointing(self, checkpointing: str) -> CostModel:
        """The same model, precision, optimizer and profile under another checkpointing mode (a
        plan may checkpoint each stage differently: `Plan.stage_checkpointing`)."""
        if checkpointing == self.checkpointing:
            return self
        hit = self._variants.get(checkpointing)
        if hit is None:
            hit = self._variants[checkpointing] = CostModel(self.model, self.precision, checkpointing,
                                                            self.optimizer, self._profile_doc, self.ep)
        return hit

    # -- unit structure ---------------------------------------------------------------------
    def _counts(self, units: Sequence[int]) -> tuple[int, int, int]:
        """(has embedding, number of blocks, has head) of a set of units, without a Python loop."""
        if isinstance(units, range) and units.step == 1:
            e = int(units.start <= 0 < units.stop)
            h = int(units.start <= self._head < units.stop)
        else:
            e, h = int(0 in units), int(self._head in units)
        return e, len(units) - e - h, h

    def _sum(self, units: Sequence[int], per_kind: Sequence[float]) -> float:
        e, n, h = self._counts(units)
        return e * per_kind[0] + n * per_kind[1] + h * per_kind[2]

    def _kind_flops(self, micro_batch: int) -> dict:
        f = self._flops.get(micro_batch)
        if f is None:
            f = self._flops[micro_batch] = kind_flops(self.model, micro_batch)
        return f

    # -- per unit ---------------------------------------------------------------------------
    def unit_params(self, unit: int) -> int:
        return self._params[KINDS.index(unit_kind(self.model, unit))]

    def unit_flops(self, unit: int, micro_batch: int) -> tuple[float, float]:
        """(forward, backward) FLOPs of one unit for one micro-batch, without recompute."""
        f = self._kind_flops(micro_batch)[unit_kind(self.model, unit)]
        return f.forward, f.backward

    def _activations(self, micro_batch: int, tp: int) -> tuple[float, float, float, float]:
        """Saved bytes per GPU of (embedding, block, head) under self.checkpointing, and of one
        block without checkpointing (the working set while a checkpointed block recomputes)."""
        key = (micro_batch, tp)
        a = self._acts.get(key)
        if a is None:
            acts = kind_activations(self.model, micro_batch, self.dtype_bytes, self.checkpointing)
            none = kind_activations(self.model, micro_batch, self.dtype_bytes, "none")[BLOCK]
            a = tuple(acts[k].per_gpu(tp) for k in KINDS) + (none.per_gpu(tp),)
            if self.profile is not None and self.checkpointing == "none":
                # measured saved bytes (costs.unit_times) replace the derived ones; what a
                # checkpointing mode keeps stays derived
                measured = [self.profile.activation_bytes(k, micro_batch, tp) for k in KINDS]
                a = tuple(m if m is not None else d for m, d in zip(measured + [measured[1]], a))
            self._acts[key] = a
        return a

    def microbatch_activation_bytes(self, units: Sequence[int], micro_batch: int, tp: int = 1) -> float:
        """Bytes one micro-batch keeps alive on a stage (or one chunk of it) between its forward and
        its backward: its units' activations, plus the fp32 input of a chunk without the embedding."""
        e, n, h = self._counts(units)
        a_e, a_b, a_h, _ = self._activations(micro_batch, tp)
        return e * a_e + n * a_b + h * a_h + (0 if e else stage_input_bytes(self.model, micro_batch))

    def deferred_bytes(self, units: Sequence[int], micro_batch: int, tp: int = 1) -> float:
        """What one micro-batch keeps on a stage (chunk) between a split backward's B and W beyond
        `microbatch_activation_bytes` (`activations.deferred_weight_bytes`): the chunk with the
        embedding runs its whole backward at W and holds only its output gradient (fp32); any other
        chunk holds its units' hooked gradients and its input's gradient (fp32), less its own fp32
        output under autocast."""
        e, n, h = self._counts(units)
        key = (micro_batch, tp)
        d = self._deferred.get(key)
        if d is None:
            kinds = deferred_weight_bytes(self.model, micro_batch, self.dtype_bytes)
            d = self._deferred[key] = tuple(kinds[k].per_gpu(tp) for k in KINDS)
        grad = float(stage_input_bytes(self.model, micro_batch))
        if e:
            return grad
        # Under autocast the chunk's fp32 output goes when B detaches it (its 16-bit copy was sent);
        # in fp32 the sent tensor is the output itself, kept by the send until the optimizer step.
        output = grad if self.dtype_bytes < 4 and not h else 0.0
        return n * d[1] + h * d[2] + grad - output

    def unit_activation_bytes(self, unit: int, micro_batch: int) -> int:
        """Bytes saved for backward by one unit for one micro-batch (tp = 1)."""
        return int(self._activations(micro_batch, 1)[KINDS.index(unit_kind(self.model, unit))])

    def boundary_bytes(self, micro_batch: int) -> int:
        return micro_batch * self.model.seq_len * self.model.hidden * self.dtype_bytes

    # -- per stage --------------------------------------------------------------------------
    def stage_params(self, units: Sequence[int]) -> int:
        e, _, h = self._counts(units)
        return int(self._sum(units, self._params)) - (self._tied if e and h else 0)

    def grad_bytes(self, units: Sequence[int], tp: int = 1) -> int:
        """Gradient bytes one GPU contributes to the DP reduction per iteration (reduced in the
        training dtype). With tp > 1 each tensor-parallel rank reduces its own 1/tp slice."""
        return int(self.stage_params(units) * self.dtype_bytes / tp)

    def _kind_times(self, gpu: GPUType, micro_batch: int, tp: int = 1) -> tuple:
        """Per kind (forward, backward_input incl. recompute, backward_weight) seconds on one GPU of
        a `tp`-way group: the profile's time at (micro_batch, tp), else costs.roofline's per-op
        time (FLOPs / (achieved FLOP/s x tp) for a GPU type without the roofline)."""
        key = (id(gpu), micro_batch, tp)
        hit = self._times.get(key)
        if hit is not None and hit[0] is gpu:
            return hit[1]
        flops = self._kind_flops(micro_batch)
        rate = gpu.achieved_flops(self.precision) * tp
        device = roofline.device_for(gpu, self.precision, self.memory_bandwidth(gpu))
        per_op = roofline.kind_seconds(self.model, micro_batch, tp, self.dtype_bytes, device, ep=self.ep) \
            if gpu.roofline else None
        out = []
        elementwise = self._elementwise_recompute(gpu, micro_batch) / tp
        for kind in KINDS:
            f = flops[kind]
            replay = recompute_share(self.checkpointing, f) if kind == BLOCK else 0.0
            if self.profile is not None and self.profile.has(kind):
                fwd, bwd = self.profile.times(kind, micro_batch, tp)
                ratio = self.profile.speed_ratio(gpu, self.precision)
                fwd, bwd = fwd * ratio, bwd * ratio
                # Measured backward split like the FLOPs; the embedding has no input gradient
                # (its input is token ids), so its whole backward is the weight scatter-add.
                split = f.backward_input / f.backward if f.backward else (0.0 if kind == EMBEDDING else 1.0)
                b_in, b_w = bwd * split, bwd * (1 - split)
            else:
                fwd, b_in, b_w = per_op[kind] if per_op else (f.forward / rate, f.backward_input / rate,
                                                             f.backward_weight / rate)
            out.append((fwd, b_in + replay * fwd + (elementwise if kind == BLOCK else 0.0), b_w))
        times = tuple(out)
        self._times[key] = (gpu, times)
        return times

    def _elementwise_recompute(self, gpu: GPUType, micro_batch: int) -> float:
        """Seconds a selective policy spends replaying a block's elementwise ops (norms, RoPE, SiLU,
        products: no FLOPs by the convention of units.py, but memory-bound): each byte it does not
        keep is written again and read once, at the HBM bandwidth. Full checkpointing's replay is
        the measured or FLOP-rated forward, which includes them."""
        if self.checkpointing not in SELECTIVE:
            return 0.0
        _, kept, _, none = self._activations(micro_batch, 1)
        return 2.0 * (none - kept) / self.memory_bandwidth(gpu)

    def stage_times(self, units: Sequence[int], gpu: GPUType, micro_batch: int, tp: int = 1) -> StageTimes:
        e, n, h = self._counts(units)
        (f0, i0, w0), (f1, i1, w1), (f2, i2, w2) = self._kind_times(gpu, micro_batch, tp)
        fwd = e * f0 + n * f1 + h * f2
        b_in = e * i0 + n * i1 + h * i2
        b_w = e * w0 + n * w1 + h * w2
        return StageTimes(forward=fwd, backward=b_in + b_w, backward_input=b_in, backward_weight=b_w)

    def stage_memory(self, units: Sequence[int], gpu: GPUType, micro_batch: int, inflight: int,
                     sharding: str, dp: int, tp: int = 1, num_microbatches: int | None = None,
                     sends: int = 0, deferred: float = 0.0) -> MemoryBreakdown:
        """Peak bytes of one step on one GPU of a stage replica (tensor-parallel rank).

        State as the runtime keeps it (`memory.runtime_state_bytes_per_param`). Activations: the
        schedule's `inflight` micro-batches of saved tensors (`activations.py`, plus the fp32
        input of a non-first stage). The step peaks at a backward with `inflight` micro-batches
        alive -- with every gradient allocated once a backward came before (more micro-batches
        than in flight), else at the first backward (no gradients yet) or the second ((inflight
        - 1) micro-batches and all gradients) -- or at the last warm-up forward; `transient` is
        the larger working set of that moment: the loss's logits and their gradients on the
        head's stage, one checkpointed block's recomputed tensors. Buffers: two posted receives
        and the sends still in flight (`sends`: the schedule's count of unfinished sends at the
        peak; their bytes are held until the iteration's end), in the boundary dtype. Data: the
        step's token ids and targets (int64) on the stages that read them. `deferred`: of the
        in-flight micro-batches, how many a split backward (zero-bubble) has run B for and not yet
        W at the peak; each also keeps `deferred_bytes`, and that peak comes at a W (a W came
        before: gradients allocated). `inflight` and `deferred` may be fractional whole-stage
        equivalents (interleaved chunks of unequal bytes: `layout.peaks.stage_peaks`).
        See docs/MEMORY.md."""
        e, n, h = self._counts(units)
        P = self.stage_params(units)
        # Unknown micro-batch count: assume a backward came before the peak (gradients allocated).
        m = inflight + 1 if num_microbatches is None else num_microbatches
        state = runtime_state_bytes_per_param(self.precision, self.optimizer, sharding, dp)
        T = micro_batch * self.model.seq_len
        V = self.model.vocab
        autocast = self.dtype_bytes < 4
        a_e, a_b, a_h, a_none = self._activations(micro_batch, tp)
        per_mb = self.microbatch_activation_bytes(units, micro_batch, tp)
        whole = replicated_expert_params(self.model, n, self.ep, sharding) if self.ep > 1 else 0   # not FSDP2's
        rep = runtime_state_bytes_per_param(self.precision, self.optimizer, "replicate", dp) if whole else state
        grads = (P * state["grads"] + whole * (rep["grads"] - state["grads"])) / tp
        recompute = (a_none - a_b) if self.checkpointing != "none" and n else 0.0
        if autocast and not fsdp_weight_copies(self.precision, sharding):
            # FSDP2 computes with its bf16 gathered weights: none of autocast's copies (a block's, where
            # kept or recomputed; the head's) exists.
            block_copy = self.dtype_bytes * (self._params[1] - 2 * self.model.hidden) / tp
            per_mb -= h * self.dtype_bytes * V * self.model.hidden / tp
            per_mb -= n * block_copy if self.checkpointing == "none" else 0.0
            recompute -= block_copy if recompute else 0.0
        # A block's backward peaks in the MLP: two T x ffn gradients live before its saved tensors go.
        mlp_grads = 2.0 * self.dtype_bytes * T * self._mlp_rows / tp if n else 0.0
        fwd_ws = max(recompute, h * (self.dtype_bytes + (4 if autocast else 0)) * T * V / tp)
        bwd_ws = max(recompute + mlp_grads, h * (8 + (self.dtype_bytes if autocast else 0)) * T * V / tp)
        if inflight <= 0:
            acts, grads_held, transient = 0.0, grads, 0.0
        else:
            candidates = [(inflight * per_mb, 0.0, fwd_ws),
                          (inflight * per_mb, grads if m > inflight else 0.0, bwd_ws)]
            if m > 1:
                candidates.append(((inflight - 1) * per_mb, grads, bwd_ws))
            if deferred > 0:
                candidates.append((inflight * per_mb + deferred * self.deferred_bytes(units, micro_batch, tp),
                                   grads, bwd_ws))
            acts, grads_held, transient = max(candidates, key=sum)
        buffers = (2 + sends) * self.boundary_bytes(micro_batch) if not (e and h) else 0.0
        gathered = P
        if sharding in ("zero3", "fsdp"):  # resharded after forward: the root group and one prefetched block
            gathered = e * self._params[0] + min(n, 1) * self._params[1] + h * self._params[2]
        buffers += gathered * state["gathered"] / tp
        data = 16.0 * T * (num_microbatches or inflight) if (e or h) else 0.0
        buffers += n * self._rope_bytes  # each block's fp32 RoPE tables
        params, opt = (P * state[k] + whole * (rep[k] - state[k]) for k in ("params", "optimizer"))
        return MemoryBreakdown(params=params / tp, grads=grads_held, optimizer=opt / tp, activations=acts,
                               buffers=buffers, transient=transient, data=data)

    def memory_bandwidth(self, gpu: GPUType) -> float:
        """HBM bytes/s for memory-bound work: measured, the GPU type's, or by the machine balance."""
        if self.profile is not None and self.profile.memory_bytes_per_s:
            return self.profile.memory_bytes_per_s
        if gpu.memory_tbps is not None:
            return gpu.memory_tbps * 1e12
        return gpu.peak_flops("bf16") / MACHINE_BALANCE_FLOP_PER_BYTE

    def optimizer_time(self, units: Sequence[int], gpu: GPUType, sharding: str, dp: int, tp: int = 1) -> float:
        """One optimizer step on one GPU: memory-bound, bytes touched / HBM bandwidth. Under
        zero1/2/3 each GPU updates only its 1/dp shard."""
        _, _, fo = sharded_fractions(sharding, dp)
        return self.stage_params(units) / tp * fo * self._step_bytes / self.memory_bandwidth(gpu)

    def tied_grad_bytes(self, sharding: str, dp: int) -> int:
        """Bytes of the tied embedding/head gradient each first- and last-stage GPU of a pipeline
        sums with its partner per iteration (`runtime.tied`): fp32 gradients, the whole matrix on
        every TP rank (TP leaves the embedding and the head whole), 1/dp of it where FSDP2 shards
        the gradients (zero2, zero3). 0 for an untied model."""
        if not self._tied:
            return 0
        return int(self._tied * 4 / (dp if sharding in ("zero2", "zero3", "fsdp") else 1))

    def gather_bytes(self, units: Sequence[int], tp: int = 1) -> int:
        """Parameter bytes one GPU's FSDP2 all-gather of these units moves in (its param dtype)."""
        return int(self.stage_params(units) * fsdp_gather_bytes_per_param(self.precision) / tp)

    def sync_collectives(self, chunks: Sequence[Sequence[int]], sharding: str, microbatches: int, tp: int = 1,
                         backend: str = "nccl") -> list[tuple[str, float]]:
        """(kind, bytes per GPU) of the DP sync's collectives per iteration of a stage whose
        pipeline chunks hold `chunks` units (comm.sync_collectives; tp=1: the whole stage). The
        parameters a sync gathers: FSDP2's in its param dtype (gather_bytes), ZeRO-1's broadcast of
        the updated fp32 parameters (4 bytes each: the optimizer's weights stay fp32 under autocast)."""
        gathered = (lambda c: int(self.stage_params(c) * 4 / tp)) if sharding == "zero1" \
            else (lambda c: self.gather_bytes(c, tp))
        return comm.sync_collectives(sharding, [(self.grad_bytes(c, tp), gathered(c)) for c in chunks],
                                     microbatches, backend)

    def dp_sync_time(self, chunks: Sequence[Sequence[int]], dp: int, dc: Datacenter, sharding: str,
                     microbatches: int, tp: int = 1) -> float:
        """DP sync per iteration inside one DC of a stage of `chunks` (comm.dp_sync_time):
        replicate/zero1 a ring all-reduce of the gradients; zero2 FSDP2's reduce-scatter and one
        parameter all-gather; zero3 the reduce-scatter and m+1 gathers (comm.fsdp_gathers). All
        of it in the sync, after the backwards: the runtime's zero3 gathers run inside forward and
        backward, where a GPU's FSDP2 prefetch can hide them behind compute, so this is what
        they cost where nothing hides them (CPU ranks, a WAN in the DP group).
        Hierarchical when the dp replicas span nodes (see comm.py)."""
        if dp <= 1:
            return 0.0
        return comm.dp_sync_time(self.sync_collectives(chunks, sharding, microbatches, tp), dp, dc, tp)

    def tp_comm_time(self, units: Sequence[int], micro_batch: int, tp: int, dc: Datacenter) -> float:
        """Megatron tensor parallelism, per micro-batch (forward + backward; half each): every
        block all-reduces its activation twice in the forward (after attention, after the MLP)
        and twice in the backward, each of boundary_bytes(micro_batch); a MoE block's experts
        also move their rows (experts.moe_comm_time: EP all-to-alls, the experts' TP all-reduces)."""
        _, n, _ = self._counts(units)
        moe = moe_comm_time(self.model, n, micro_batch, self.dtype_bytes, self.ep, tp, dc)
        if tp <= 1 or (self.profile is not None and self.profile.includes_tp_comm(BLOCK, tp)):
            return moe if tp <= 1 else 0.0   # a block profiled at tp > 1 holds its all-reduces (costs.unit_times)
        return moe + 4 * n * comm.allreduce_time(self.boundary_bytes(micro_batch), tp, dc.gpus_per_node, dc)

    def training_flops(self, tokens: int) -> float:
        """FLOPs of forward + backward of the whole model over `tokens` tokens (no recompute):
        6 * (matmul parameters) * tokens + 12 * layers * hidden * seq_len * tokens."""
        f = self._kind_flops(1)
        per_sequence = (f[EMBEDDING].forward + f[EMBEDDING].backward
                        + self.model.layers * (f[BLOCK].forward + f[BLOCK].backward)
                        + f[HEAD].forward + f[HEAD].backward)
        return per_sequence * tokens / self.model.seq_len
