"""DiLoCo on one rank: the outer loop around the Trainer's inner steps (Plan.outer).

The rank keeps, for its own parameters (a local shard under FSDP2 / TP), the anchor (the outer
parameters at the last sync) and the outer momentum, in the parameters' dtype and layout so DCP
checkpoints them like the model. After an inner step, each fragment the plan schedules
(`OuterPlan.syncs_after`) averages its pseudo-gradient anchor - theta over the workers
(runtime.outer_group) and, `overlap` steps later, applies Nesterov SGD: `DiLoCo` has the update.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from geotrain.runtime.outer_group import OuterGroup
from geotrain.runtime.scaler import _local

JOIN_TAG = 1 << 40      # transport tags of the state a rejoining worker receives (exchanges use small ones)


def fragments_of(sizes: list[int], f: int) -> list[list[int]]:
    """Indices 0..n-1 cut into `f` contiguous groups of about equal total size (a group may be empty)."""
    total, out, acc = sum(sizes), [[] for _ in range(f)], 0
    for i, n in enumerate(sizes):
        g = min(f - 1, int(f * (acc + n / 2) / total)) if total else 0
        out[g].append(i)
        acc += n
    return out


class DiLoCo:
    """The outer loop of one rank. Its parameters are cut into F fragments (contiguous in name order,
    balanced by size; each rank cuts its own, so fragment f is the union of every rank's f-th part).
    After inner step t, fragment f starts an exchange when `OuterPlan.syncs_after(t)` names it (F = 1:
    every H steps; streaming: fragment f at (f+1) H/F, then every H): anchor - theta is averaged over
    the workers (compressed as the plan says) and, `overlap` inner steps later, applied by Nesterov SGD:
        m = mu m + avg;  anchor -= lr (avg + mu m)   (plain momentum: lr m);  theta = anchor
    -- with overlap, theta = mix theta_now + (1 - mix) anchor keeps part of the steps taken meanwhile.
    DP replicas holding the same parameters (replicate, zero1) split the exchange: replica d exchanges
    slice d and they all-gather the averages between steps; FSDP2 ranks exchange their shard whole."""

    def __init__(self, outer, named: list[tuple[str, nn.Parameter]], group: OuterGroup | None,
                 replicated_dp: int = 1, replica: int = 0, dp_group=None, recorder=None, link: str = ""):
        self.o, self.group, self.link = outer, group, link
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.dp, self.replica, self.dp_group = replicated_dp, replica, dp_group
        self.recorder = recorder
        with torch.no_grad():
            self.anchor = {n: p.detach().clone() for n, p in named}
            self.momentum = {n: torch.zeros_like(p) for n, p in named}
            self.pending = {n: torch.zeros_like(p) for n, p in named}   # averages waiting to be applied
        self.frags = fragments_of([_local(p).numel() for p in self.params], outer.fragments)
        self.due: dict[int, int] = {}                 # fragment -> inner step its average is applied after
        self.inflight: dict[int, Future] = {}
        self.ready: set[int] = set()                  # fragments whose average sits in self.pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="outer") if outer.overlap else None
        self.syncs: list[tuple[int, int]] = []        # (step, fragment) of every exchange started
        self.step = 0
        self.joining = False                          # a restarted worker: join() before training

    # -- the schedule ---------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """Called after inner step `step` (1-based): apply what is due, start what the plan starts."""
        self.step = step
        for f in sorted(f for f, at in self.due.items() if at == step):
            self._apply(f)
        for f in self.o.syncs_after(step):
            self._start(f, step)
            if not self.o.overlap:
                self._apply(f)

    def finish(self) -> None:
        """The end of training: apply every average still in flight or waiting, now."""
        for f in sorted(self.due):
            self._apply(f)
        if self.group is not None:
            self.group.finished()

    def settle(self) -> None:
        """Wait for exchanges in flight (a checkpoint stores their averages, applied when due)."""
        for f in list(self.inflight):
            self._collect(f)

    # -- one fragment -----------------------------------------------------------------------------
    def _vector(self, f: int) -> torch.Tensor:
        """Fragment f's pseudo-gradient on this rank (flat fp32), or this replica's slice of it."""
        with torch.no_grad():
            parts = [(_local(self.anchor[self.names[i]]) - _local(self.params[i])).reshape(-1).float()
                     for i in self.frags[f]]
        v = torch.cat(parts) if parts else torch.zeros(0)
        if self.dp > 1:
            v = self._slices(v)[self.replica]
        return v.cpu()

    def _slices(self, v: torch.Tensor) -> list[torch.Tensor]:
        k = -(-v.numel() // self.dp)
        return list(torch.nn.functional.pad(v, (0, k * self.dp - v.numel())).split(k))

    def _start(self, f: int, step: int) -> None:
        self.syncs.append((step, f))
        v = self._vector(f)
        t0 = self.recorder.now() if self.recorder is not None else 0.0
        if self._pool is None:
            fut: Future = Future()
            fut.set_result(self._timed(v, t0))
        else:
            fut = self._pool.submit(self._timed, v, t0)
        self.inflight[f] = fut
        self.due[f] = step + self.o.overlap

    def _timed(self, v: torch.Tensor, t0: float) -> tuple[torch.Tensor, float, float, int]:
        before = self.group.sent_bytes if self.group is not None else 0
        avg = self._average(v)
        sent = (self.group.sent_bytes if self.group is not None else 0) - before
        return avg, t0, self.recorder.now() if self.recorder is not None else 0.0, sent

    def _average(self, v: torch.Tensor) -> torch.Tensor:
        if self.group is None:          # one worker: the average is its own
            return v
        return self.group.average(v, self.o.compression)

    def _collect(self, f: int) -> None:
        """The exchange's average into self.pending (the DP replicas' slices gathered)."""
        fut = self.inflight.pop(f)
        waited = self.recorder.now() if self.recorder is not None and not fut.done() else None
        avg, t0, t1, sent = fut.result()
        if self.recorder is not None:      # the exchange on the WAN; the part the training thread waited for
            self.recorder.add("outer_sync", t0, t1, stage=f, nbytes=sent, link=self.link)
            if waited is not None:
                self.recorder.add("outer_wait", waited, self.recorder.now(), stage=f)
        if self.dp > 1:
            k = avg.numel()
            parts = [torch.empty(k) for _ in range(self.dp)]
            dist.all_gather(parts, avg.contiguous(), group=self.dp_group)
            avg = torch.cat(parts)
        at = 0
        with torch.no_grad():
            for i in self.frags[f]:
                dst = _local(self.pending[self.names[i]])
                dst.copy_(avg[at:at + dst.numel()].view(dst.shape).to(dst.dtype))
                at += dst.numel()
        self.ready.add(f)

    def _apply(self, f: int) -> None:
        if f in self.inflight:
            self._collect(f)
        self.due.pop(f, None)
        self.ready.discard(f)
        o, mix = self.o, (self.o.mix if self.o.overlap else 0.0)
        with torch.no_grad():
            for i in self.frags[f]:
                n = self.names[i]
                avg, m, anchor, p = (_local(t) for t in (self.pending[n], self.momentum[n], self.anchor[n],
                                                         self.params[i]))
                m.mul_(o.momentum).add_(avg)
                step = avg.add(m, alpha=o.momentum) if o.nesterov else m
                anchor.sub_(step, alpha=o.lr)
                if mix:
                    p.mul_(mix).add_(anchor, alpha=1 - mix)
                else:
                    p.copy_(anchor)
                avg.zero_()
        if self.group is not None and self.group.admitted:
            self._admit(step_after=self.step)

    # -- a worker rejoining ---------------------------------------------------------------------------
    def _flat(self, tensors: dict) -> torch.Tensor:
        return torch.cat([_local(tensors[n]).reshape(-1).float().cpu() for n in self.names]) if self.names \
            else torch.zeros(0)

    def _admit(self, step_after: int) -> None:
        """After an exchange that admitted joiners: the lowest surviving worker's rank sends each its
        state -- anchor, momentum, and the step it continues after; the others only note them."""
        g = self.group
        joiners, g.admitted = g.admitted, []
        survivors = [m for m in g.members if m not in joiners]
        if g.me != min(survivors):
            return
        meta = torch.tensor([step_after, g.exchanges], dtype=torch.int64)
        for m in joiners:
            g.welcome(m, g.members)
            works = [g.transport.send(t, g.ident(m), JOIN_TAG + k)
                     for k, t in enumerate((self._flat(self.anchor), self._flat(self.momentum), meta))]
            for w in works:
                w.wait()
            print(f"geotrain diloco: worker {m[0]} rejoined after step {step_after} with worker {g.worker}'s state",
                  flush=True)

    def join(self) -> int:
        """(A restarted worker) wait to be admitted, take the state sent, return the step to continue after."""
        g = self.group
        g.announce()
        sender = g.welcomed()
        n = sum(_local(p).numel() for p in self.params)
        bufs = [torch.empty(n), torch.empty(n), torch.empty(2, dtype=torch.int64)]
        for k, b in enumerate(bufs):
            g.transport.recv(b, g.ident(sender), JOIN_TAG + k).wait()
        at = 0
        with torch.no_grad():
            for n_, p in zip(self.names, self.params, strict=True):
                dst = [_local(t) for t in (self.anchor[n_], self.momentum[n_], p)]
                k = dst[0].numel()
                dst[0].copy_(bufs[0][at:at + k].view(dst[0].shape))
                dst[1].copy_(bufs[1][at:at + k].view(dst[1].shape))
                dst[2].copy_(dst[0])
                at += k
        self.step = int(bufs[2][0])
        return self.step

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Tensors for DCP, keyed by the model's plain names (`runtime.checkpoint`): call settle() first."""
        due = [self.due.get(f, -1) if f in self.ready else -1 for f in range(self.o.fragments)]
        return {"anchor": dict(self.anchor), "momentum": dict(self.momentum), "pending": dict(self.pending),
                "due": torch.tensor(due, dtype=torch.int64),
                "exchanges": torch.tensor(self.group.exchanges if self.group else 0, dtype=torch.int64)}

    def loaded(self, state: dict) -> None:
        """After DCP filled state_dict()'s tensors in place: the schedule's part."""
        for f, at in enumerate(int(x) for x in state["due"]):
            if at >= 0:
                self.due[f] = at
                self.ready.add(f)
        if self.group is not None:
            self.group.exchanges = int(state["exchanges"])

    def restart_from_params(self) -> None:
        """No outer state in the checkpoint (a run that was not DiLoCo): the parameters are the anchor."""
        with torch.no_grad():
            for n, p in zip(self.names, self.params, strict=True):
                _local(self.anchor[n]).copy_(_local(p))
                _local(self.momentum[n]).zero_()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.group is not None:
            self.group.close()
