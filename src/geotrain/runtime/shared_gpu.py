"""Ranks sharing one GPU: which communicators would hold two ranks on one device, and what runs instead.

Each rank works on `cuda:LOCAL_RANK % GPUs`, so a host with fewer GPUs than ranks puts several on
one device, and NCCL refuses a communicator holding two of them. Every rank's device identity is
exchanged once, and every rank takes the same decision for every group (`SharedDevices`): pipeline
transfers, DP collectives (FSDP2 through its public custom-comm hooks) and the tied sum are staged
through host memory over gloo; a TP or ZeRO-1 group on one device is refused in one line, before
launch by our launcher (`host_devices.device_problem`, torch-free). `GEOTRAIN_FAKE_GPUS=N` makes CPU
ranks report N devices, so the staged paths run in the CPU tests.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from geotrain.errors import GeotrainError
from geotrain.runtime.host_devices import FAKE_GPUS_ENV, dp_group, key_of, shares, sharing_problem, tied_group
from geotrain.torch_compat import fsdp_comm_bases

_AllGather, _ReduceScatter = fsdp_comm_bases()


def device_key(device: torch.device) -> int:
    """This rank's device identity as a positive int64 (0: a CPU rank, which shares nothing NCCL sees)."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        return key_of(f"{socket.gethostname()}:{int(os.environ.get('LOCAL_RANK', 0)) % max(1, int(fake))}")
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return key_of(str(uuid) if uuid is not None else f"{socket.gethostname()}:{device.index}")


def exchange_keys(key: int) -> list[int]:
    """Every rank's `device_key`, on every rank (one all-gather of an int64 over gloo)."""
    mine = torch.tensor([key], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [int(t) for t in out]


@dataclass
class SharedDevices:
    """What this rank stages through host memory because its communicator would share a device:
    pipeline transfers over gloo (`p2p.HostStaging`); a DP group's FSDP2 all-gather and
    reduce-scatter (`StagedAllGather`, `StagedReduceScatter`), replicated all-reduce and loss sum on
    host copies over the group's gloo backend; the tied-embedding sum likewise. A TP or ZeRO-1 group
    cannot be staged (DTensor's collectives and ZeroRedundancyOptimizer's broadcasts have no hook)."""

    dp: bool = False                     # its DP group (FSDP2 comms, replicated all-reduce, loss sum)
    tied: bool = False                   # its tied-embedding group
    peers: set[int] = field(default_factory=set)     # pipeline peers on its own device
    note: str = ""                       # one line for the log (empty: nothing staged anywhere)

    @classmethod
    def of(cls, plan, rank: int, keys: list[int]) -> SharedDevices:
        """The decision for `rank` (every rank decides the same for each group: it reads the same table)."""
        problem = sharing_problem(plan, keys)
        if problem:
            raise GeotrainError(problem)
        stage, replica, t = plan.coords(rank)
        out = cls(dp=shares(keys, dp_group(plan, stage, t)),
                  tied=plan.pp > 1 and t < min(plan.stage_tp(0), plan.stage_tp(plan.pp - 1))
                  and shares(keys, tied_group(plan, replica, t)),
                  peers={r for r in range(plan.num_ranks) if r != rank and keys[r] and keys[r] == keys[rank]})
        staged_dp = any(shares(keys, dp_group(plan, s, tt))
                        for s in range(plan.pp) for tt in range(plan.stage_tp(s)))
        staged_pp = any(keys[a] and keys[a] == keys[b] for a in range(plan.num_ranks) for b in range(a)
                        if plan.coords(a)[0] != plan.coords(b)[0])
        if staged_dp or staged_pp:
            what = [w for w, on in (("DP groups (FSDP2 all-gather/reduce-scatter, all-reduces, the loss sum)",
                                     staged_dp), ("pipeline transfers between ranks on one GPU", staged_pp)) if on]
            out.note = (f"geotrain: {plan.num_ranks} ranks share {len(set(k for k in keys if k))} GPU(s): "
                        f"{' and '.join(what)} run over gloo through host memory (NCCL refuses two ranks of a "
                        "communicator on one GPU)")
        return out

    def say(self, rank: int) -> None:
        if self.note and rank == 0:
            print(self.note, file=sys.stderr, flush=True)


# -- host staging ----------------------------------------------------------------------------------
def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (always a copy: the result is written back with `from_host`)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def all_reduce_staged(t: torch.Tensor, group, staged: bool, op=dist.ReduceOp.SUM) -> None:
    """dist.all_reduce(t) -- through a host copy over the group's gloo backend when `staged`."""
    if not staged:
        dist.all_reduce(t, op=op, group=group)
        return
    host = to_host(t)
    dist.all_reduce(host, op=op, group=group)
    t.copy_(host)


class StagedAllGather(_AllGather):
    """FSDP2's all-gather through host memory: the group's CPU (gloo) backend, synchronously. FSDP2
    calls it on its all-gather stream, where the copies are ordered after the copy-in."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype, device="cpu")
        work = dist.all_gather_into_tensor(out, to_host(input_tensor), group=group, async_op=async_op)
        if work is not None:
            work.wait()
        output_tensor.copy_(out)
        return work


class StagedReduceScatter(_ReduceScatter):
    """FSDP2's reduce-scatter through host memory (see StagedAllGather)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype, device="cpu")
        work = dist.reduce_scatter_tensor(out, to_host(input_tensor), op=op, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        output_tensor.copy_(out)
        return work


def stage_fsdp(module: torch.nn.Module) -> None:
    """Send every FSDP2 group of a chunk's collectives through host memory (public FSDP2 hooks)."""
    for sub in module.modules():
        if hasattr(sub, "set_custom_all_gather"):
            sub.set_custom_all_gather(StagedAllGather())
            sub.set_custom_reduce_scatter(StagedReduceScatter())
