"""The action interpreter: runs one rank's per-stage action list (the simulator's schedule) for real.

Each Action names a virtual stage, a micro-batch and a peer; the interpreter keeps, per
(virtual stage, micro-batch), the stage input and output whose autograd graph the backward
needs, and moves boundary tensors through a `Transport` (as 1/tp slices plus a TP all-gather
between stages of equal tp, see `tp_group`) in `boundary_dtype` (the training
precision: what the planner counted), back in fp32 on arrival. Sends are non-blocking (waited at the
optimizer step); receives are posted a few actions early (`lookahead`, where
`schedule.posting.post_points` says: the one posting that `check_schedule` proves cannot deadlock
on an in-order transport such as NCCL) so a transfer can land while the rank computes, and waited
for at their RECV action -- the waiting time is recorded as `recv_wait`. Receive buffers and the
loss live on the rank's `device`. The OPTIMIZER action ends every list: there the interpreter waits
for its sends and returns; the step itself is the caller's (`trainer.Trainer`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from geotrain.layout.plan import Plan
from geotrain.models.moe import aux_loss_scale
from geotrain.runtime.activation_ckpt import weight_gradients_in_one_pass
from geotrain.runtime.expert_parallel import reduce_expert_grads, split_expert_params
from geotrain.runtime.p2p import Transport, make_tag
from geotrain.runtime.parallelize import allreduce_grads, fsdp_no_sync, fsdp_reduce_grads, fsdp_unshard, is_fsdp
from geotrain.runtime.recorder import Recorder
from geotrain.schedule.actions import Action, Op, Schedule
from geotrain.schedule.posting import RECVS, RUNTIME_LOOKAHEAD, post_points
from geotrain.torch_compat import stage_backward_input, stage_backward_weight

ACT, GRAD = 0, 1


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def slice_numel(numel: int, tp: int) -> int:
    """Elements of one TP rank's slice of a scattered boundary tensor (what the receiver posts)."""
    return -(-numel // tp)


def boundary_slice(tensor: torch.Tensor, tp: int, index: int) -> torch.Tensor:
    """TP rank `index`'s slice of a boundary tensor sent scattered: 1/tp of it flattened, the tail
    zero-padded to tp x slice_numel when tp does not divide it. (No model shape needs the padding
    today -- tp divides the heads, which divide hidden -- but a slice never assumes it.)"""
    k = slice_numel(tensor.numel(), tp)
    flat = F.pad(tensor.reshape(-1), (0, k * tp - tensor.numel()))
    return flat[index * k:(index + 1) * k].contiguous()


def boundary_from_slices(full: torch.Tensor, shape) -> torch.Tensor:
    """The boundary tensor from its tp slices laid end to end (the all-gather's output), padding dropped."""
    return full[:_numel(shape)].view(shape)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every token of the micro-batch (computed in fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class _Slot:
    """What one (virtual stage, micro-batch) keeps between its forward and its backward."""

    inp: torch.Tensor | None = None
    out: torch.Tensor | None = None          # stage output, or the (scaled) loss on the last stage
    param_groups: list | None = None         # zero-bubble: intermediates saved by backward_input
    weight_deferred: bool = False            # first stage under a split backward: all of it runs at W
    grad: torch.Tensor | None = None         # the output gradient kept for a deferred backward


@dataclass
class PipelineRank:
    """Executes one physical stage's action list for one DP replica."""

    plan: Plan
    schedule: Schedule
    stage: int                                   # physical stage
    replica: int
    chunks: dict[int, nn.Module]                 # virtual stage -> module
    transport: Transport
    recorder: Recorder
    autocast: Callable
    boundary_shape: tuple[int, ...]
    # TP index of this rank. After the row-parallel layers every TP rank holds the whole activation
    # (and input gradient). Between stages of different tp receiving TP rank t' of a neighbour takes
    # it whole from sending rank t' mod tp_sender: a rank of the narrower stage feeds several of the
    # wider one, one of the wider stage with t >= the narrower tp sends nothing (equal tps: `tp_group`).
    tp_rank: int = 0
    # This stage's TP group (None at tp=1). Where a neighbour runs the same tp, a boundary tensor
    # moves scattered: TP rank t sends only slice t (1/tp of the flattened tensor, the last slice
    # zero-padded when tp does not divide it) to TP rank t there, which all-gathers the slices in
    # this group (inside the node) to rebuild the whole tensor -- Megatron's scatter-gather; a copy,
    # so bit-identical, with 1/tp of the bytes on the link. Mixed-tp boundaries send whole copies.
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    dp_staged: bool = False                      # the DP group shares a GPU: reduce through host memory (shared_gpu)
    lookahead: int = RUNTIME_LOOKAHEAD
    boundary_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    bubble: object | None = None   # BubbleTea hook: fill_and_wait(index, work, stage), end_iteration()
    _slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_virtual = self.schedule.num_virtual
        self.last_virtual = self.num_virtual - 1
        self.my_rank = self.plan.rank(self.stage, self.replica, self.tp_rank)
        self.actions: list[Action] = self.schedule.actions[self.stage]
        missing = {a.stage for a in self.actions if a.op.is_compute and a.stage not in self.chunks}
        if missing:
            raise RuntimeError(f"stage {self.stage} has actions for virtual stages {sorted(missing)} it does not hold")
        if not self.actions or self.actions[-1].op != Op.OPTIMIZER:
            raise RuntimeError(f"stage {self.stage}'s action list must end with its OPTIMIZER action")
        self._posts = post_points(self.actions, self.lookahead)

    # -- helpers ---------------------------------------------------------------------------
    def rank_of(self, virtual_stage: int) -> int:
        """The rank this one receives from in `virtual_stage`'s stage: TP index t mod its tp."""
        s = virtual_stage % self.plan.pp
        return self.plan.rank(s, self.replica, self.tp_rank % self.plan.stage_tp(s))

    def ranks_to(self, virtual_stage: int) -> list[int]:
        """The ranks of `virtual_stage`'s stage this one sends to: TP indices t' = t mod this tp."""
        s = virtual_stage % self.plan.pp
        return [self.plan.rank(s, self.replica, t)
                for t in range(self.tp_rank, self.plan.stage_tp(s), self.plan.stage_tp(self.stage))]

    def _scattered(self, virtual_stage: int) -> bool:
        """Whether the boundary with `virtual_stage`'s stage moves 1/tp slices (equal tp > 1)."""
        return self.tp_group is not None and self.plan.boundary_scattered(self.stage, virtual_stage % self.plan.pp)

    def _slice_numel(self) -> int:
        return slice_numel(_numel(self.boundary_shape), self.plan.stage_tp(self.stage))

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        """The whole boundary tensor from every TP rank's slice (all-gather in this stage's TP group)."""
        tp = self.plan.stage_tp(self.stage)
        full = torch.empty(tp * part.numel(), dtype=part.dtype, device=part.device)
        dist.all_gather(list(full.chunk(tp)), part, group=self.tp_group)
        return boundary_from_slices(full, self.boundary_shape)

    def _tag(self, kind: int, src_virtual: int, mb: int) -> int:
        return make_tag(kind, src_virtual, mb, self.num_virtual, self.schedule.num_microbatches)

    def _post_recv(self, i: int) -> None:
        a = self.actions[i]
        shape = (self._slice_numel(),) if self._scattered(a.peer) else self.boundary_shape
        buf = torch.empty(shape, dtype=self.boundary_dtype, device=self.device)
        kind = ACT if a.op == Op.RECV_ACT else GRAD
        self._posted[i] = (buf, self.transport.recv(buf, self.rank_of(a.peer), self._tag(kind, a.peer, a.mb)))

    def _post(self, i: int) -> None:
        """Post the transfers `post_points` places before action i: receives get a buffer, sends
        their tensor (computed by an earlier action)."""
        for batch in self._posts[i]:
            for j in batch:
                a = self.actions[j]
                if a.op in RECVS:
                    self._post_recv(j)
                elif a.op == Op.SEND_ACT:
                    self._send(ACT, a, self._slots[(a.stage, a.mb)].out)
                else:
                    self._send(GRAD, a, self._slots[(a.stage, a.mb)].inp.grad)

    def _send(self, kind: int, a: Action, tensor: torch.Tensor) -> None:
        dsts = self.ranks_to(a.peer)
        if self.my_rank in dsts:
            raise RuntimeError(f"{a}: a schedule sends only between physical stages (check_schedule)")
        if not dsts:
            return   # the receiving stage is narrower: its ranks take this tensor from a lower TP index
        t = tensor.detach().to(self.boundary_dtype).contiguous()
        if self._scattered(a.peer):          # this TP rank's slice only (dsts is the same TP index)
            t = boundary_slice(t, self.plan.stage_tp(self.stage), self.tp_rank)
        src_dc, dst_dc = self.plan.dc_of(self.stage, self.replica), self.plan.dc_of(a.peer % self.plan.pp, self.replica)
        link = f"{src_dc}->{dst_dc}" if src_dc != dst_dc else ""
        for dst in dsts:
            t_start = self.recorder.now()
            work = self.transport.send(t, dst, self._tag(kind, a.stage, a.mb))
            self._sends.append((work, t_start, t.numel() * t.element_size(), link, dst, a))

    # -- one iteration ---------------------------------------------------------------------
    def run_iteration(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]], loss_scale: float = 1.0,
                      wait_sends: bool = True) -> float:
        """Execute the action list once, up to its OPTIMIZER action (the last). `batches[mb] = (inputs,
        targets)`, needed by ranks holding the first or last virtual stage. Returns the sum over
        micro-batches of this replica's loss / m (0.0 on ranks without the last virtual stage).
        `wait_sends` False: the sends are left to `finish_sends` (the caller posts the gradient norm's
        exchange first)."""
        m = self.schedule.num_microbatches
        self._slots, self._posted, self._sends = {}, {}, []
        self._acts: dict[tuple[int, int], torch.Tensor] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}
        for chunk in self.chunks.values():
            if is_fsdp(chunk):
                fsdp_no_sync(chunk)
        loss_sum = torch.zeros((), device=self.device)
        rec = self.recorder
        for i, a in enumerate(self.actions):
            self._post(i)
            op, v, mb = a.op, a.stage, a.mb
            if op in RECVS:
                buf, work = self._posted.pop(i)
                t0 = rec.mark()
                if work is not None and self.bubble is not None:
                    t0 = self.bubble.fill_and_wait(i, work, v)  # prefill in the predicted bubble, then wait
                elif work is not None:
                    work.wait()
                nbytes = buf.numel() * buf.element_size()
                if self._scattered(a.peer):     # part of the wait, as the simulator counts it
                    buf = self._gather(buf)
                end = rec.now() if isinstance(t0, float) and self.bubble is not None else rec.mark()
                rec.add("recv_wait", t0, end, stage=v, mb=mb, nbytes=nbytes, peer=self.rank_of(a.peer))
                (self._acts if op == Op.RECV_ACT else self._grads)[(v, mb)] = buf
            elif op == Op.FORWARD:
                t0 = rec.mark()
                loss_sum += self._forward(v, mb, batches, m, loss_scale)
                rec.add("forward", t0, rec.mark(), stage=v, mb=mb)
            elif op == Op.SEND_ACT:
                pass                                   # posted by _post
            elif op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                t0 = rec.mark()
                self._backward(op, v, mb)
                rec.add(op.value, t0, rec.mark(), stage=v, mb=mb)
            elif op == Op.SEND_GRAD:
                if self._slots[(v, mb)].param_groups is None and not self._slots[(v, mb)].weight_deferred:
                    del self._slots[(v, mb)]
            elif op == Op.ALLREDUCE:
                t0 = rec.mark()
                self._reduce_grads()
                rec.add("allreduce", t0, rec.mark(), stage=v)
            elif op == Op.OPTIMIZER:
                pass                                   # the end of the list: the caller steps
            elif op == Op.PREFILL:
                pass  # BubbleTea work runs where the rank would wait (the `bubble` hook), not as an action
            else:
                raise RuntimeError(f"unknown action {a}")
        if wait_sends:
            self._wait_sends()
        self._slots.clear()
        rec.flush()              # the trace: GPU events of this iteration that have completed (no waiting)
        if self.bubble is not None:
            self.bubble.end_iteration()
        return float(loss_sum)

    def finish_sends(self) -> None:
        """Wait for the iteration's sends (after run_iteration(wait_sends=False))."""
        self._wait_sends()

    @torch.no_grad()
    def evaluate(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The held-out loss of `batches` through the pipeline, forward only: the action list's
        receives, forwards and sends of activations, in its order (a subsequence of a deadlock-free
        list whose dependencies all point forward), each receive waited at once, nothing recorded.
        Returns what run_iteration does: this replica's loss sum / m (0.0 off the last stage)."""
        m = self.schedule.num_microbatches
        loss_sum = torch.zeros((), device=self.device)
        outs: dict[tuple[int, int], torch.Tensor] = {}
        self._acts, self._sends = {}, []
        enabled, self.recorder.enabled = self.recorder.enabled, False
        try:
            for a in self.actions:
                v, mb = a.stage, a.mb
                if a.op == Op.RECV_ACT:
                    shape = (self._slice_numel(),) if self._scattered(a.peer) else self.boundary_shape
                    buf = torch.empty(shape, dtype=self.boundary_dtype, device=self.device)
                    work = self.transport.recv(buf, self.rank_of(a.peer), self._tag(ACT, a.peer, mb))
                    if work is not None:
                        work.wait()
                    self._acts[(v, mb)] = self._gather(buf) if self._scattered(a.peer) else buf
                elif a.op == Op.FORWARD:
                    inp = batches[mb][0] if v == 0 else self._acts.pop((v, mb)).to(torch.float32)
                    with self.autocast():
                        out = self.chunks[v](inp)
                    if v == self.last_virtual:
                        loss_sum += lm_loss(out, batches[mb][1]) / m
                    else:
                        outs[(v, mb)] = out
                elif a.op == Op.SEND_ACT:
                    self._send(ACT, a, outs.pop((v, mb)))
            self._wait_sends()
        finally:
            self.recorder.enabled = enabled
        return float(loss_sum)

    def _wait_sends(self) -> None:
        """Wait for this iteration's sends. A cross-DC send becomes a `transfer` event on its WAN
        link, from when the transport says it entered the link (`started_at`: after its temporal
        turn and the earlier messages to that peer; else when it was posted) to when its last byte
        left (`finished_at`, wall clock) -- or, for a transport that does not say, a zero-length
        event that still counts the bytes."""
        sends, self._sends = self._sends, []
        rec = self.recorder
        for work, t_start, nbytes, link, dst, a in sends:
            work.wait()
            nbytes = getattr(work, "wire_bytes", nbytes)     # a compressed link: what went on the wire
            if link:
                done = getattr(work, "finished_at", None)
                began = getattr(work, "started_at", None)
                if began is not None:
                    t_start = max(t_start, began - rec.t0)
                end = max(t_start, done - rec.t0) if done is not None else t_start
                rec.add("transfer", t_start, end, stage=a.stage, mb=a.mb, nbytes=nbytes, peer=dst, link=link)

    def _forward(self, v: int, mb: int, batches, m: int, loss_scale: float) -> torch.Tensor:
        chunk = self.chunks[v]
        if v == 0:
            inp = batches[mb][0]
        else:
            inp = self._acts.pop((v, mb)).to(torch.float32).requires_grad_(True)
        with self.autocast(), aux_loss_scale(loss_scale / m):   # MoE load balancing: like this micro-batch's loss
            out = chunk(inp)
        slot = _Slot(inp=inp)
        self._slots[(v, mb)] = slot
        if v == self.last_virtual:
            loss = lm_loss(out, batches[mb][1]) / m
            slot.out = loss * loss_scale if loss_scale != 1.0 else loss
            return loss.detach()
        slot.out = out
        return torch.zeros((), device=self.device)

    def _backward(self, op: Op, v: int, mb: int) -> None:
        slot = self._slots[(v, mb)]
        params = self.chunks[v].parameters
        if op != Op.BACKWARD and is_fsdp(self.chunks[v]):
            fsdp_unshard(self.chunks[v])   # params() must name the gathered weights the graph used
        if op == Op.BACKWARD_WEIGHT and not slot.weight_deferred:
            if getattr(self.chunks[v], "checkpointing", "none") == "none":
                stage_backward_weight(params(), slot.param_groups)
            else:  # one recompute per checkpointed region, not one per parameter group
                weight_gradients_in_one_pass(params(), slot.param_groups)
            del self._slots[(v, mb)]
            return
        if op == Op.BACKWARD_WEIGHT:           # deferred whole backward of the first stage
            grad = slot.grad
        else:
            grad = None if v == self.last_virtual else self._grads.pop((v, mb)).to(slot.out.dtype)
        if op == Op.BACKWARD_INPUT and v == 0:
            # The first stage has no input gradient to send: all of its backward runs at W.
            slot.weight_deferred, slot.grad = True, grad
            return
        if op == Op.BACKWARD_INPUT:
            grads = None if grad is None else [grad]
            _, slot.param_groups = stage_backward_input([slot.out], grads, [slot.inp], params())
            slot.out = None
            return
        torch.autograd.backward(slot.out, grad)
        slot.out = None
        if v == 0:                              # nothing to send back: done with this micro-batch
            del self._slots[(v, mb)]

    def _reduce_grads(self) -> None:
        plain: list[nn.Parameter] = []
        for chunk in self.chunks.values():
            dense, experts = split_expert_params(chunk)
            if is_fsdp(chunk):
                fsdp_reduce_grads(chunk)
            else:
                plain.extend(dense)
            reduce_expert_grads(chunk, experts, self.plan.dp)
        if plain and self.plan.dp > 1:
            allreduce_grads(plain, self.dp_group, self.plan.dp, dtype=self.boundary_dtype, staged=self.dp_staged)
