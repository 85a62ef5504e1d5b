"""What one rank trains: its place in the plan, its device and mesh, its model chunks.

Ranks follow the plan's table (`plan.rank(stage, replica, t)`: stage-major, a region plan
pipeline-major; TP innermost), so the (pp, dp, tp) device mesh built from it has one DP group per
stage and TP index -- inside the stage's DC, or across a region plan's DCs -- and one TP group of
consecutive ranks (inside a node) per stage replica. Building is collective (process groups), so
every rank builds in the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from geotrain.errors import GeotrainError
from geotrain.runtime.materialize import build_chunk
from geotrain.runtime.meshes import stage_mesh
from geotrain.runtime.shared_gpu import SharedDevices, device_key, exchange_keys, stage_fsdp
from geotrain.runtime.tied import TiedCopies


def rank_device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK, modulo the GPUs this host has: ranks may share one,
    e.g. two emulated DCs on one GPU) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class RankModel:
    """This rank's coordinates in the plan and the modules it holds (virtual stage -> chunk)."""

    rank: int
    stage: int
    replica: int
    tp_rank: int
    device: torch.device
    mesh: DeviceMesh
    chunks: dict[int, nn.Module]
    tied: TiedCopies
    shared: SharedDevices       # the communicators staged through host memory (ranks sharing a GPU)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for m in self.chunks.values() for p in m.parameters()]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    def tp_group(self, plan) -> dist.ProcessGroup | None:
        return self.mesh["tp"].get_group() if plan.stage_tp(self.stage) > 1 else None


def build_rank_model(spec, plan) -> RankModel:
    """Seed, build this rank's mesh and chunks -- on the meta device, materialised already sharded
    (`materialize.build_chunk`: random init, or the HF checkpoint's tensors) -- and its tied copies."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.num_ranks:
        raise GeotrainError(f"plan {plan.name!r} needs {plan.num_ranks} ranks (pp={plan.pp} x dp={plan.dp} "
                            f"x tp={plan.tp_label()}) but {world} were started")
    stage, replica, tp_rank = plan.coords(rank)
    device = rank_device()
    shared = SharedDevices.of(plan, rank, exchange_keys(device_key(device)))   # collective; refuses TP/ZeRO-1 sharing
    shared.say(rank)
    torch.manual_seed(spec.job.seed)
    # One (pp, dp, tp) mesh holding the plan's rank table, so its "dp" slices are each stage's replicas
    # whatever the numbering. FSDP2 over "dp" and TP over "tp" must be slices of the same mesh to compose.
    mesh = stage_mesh(device.type, plan, stage)
    stage_plan = plan.with_(checkpointing=plan.stage_checkpointing(stage))  # this stage's own mode
    chunks = {c * plan.pp + stage: build_chunk(spec.model, a, b, stage_plan, mesh, device, hf=spec.model.hf)
              for c, (a, b) in enumerate(plan.stages[stage].chunks)}
    if shared.dp:
        for chunk in chunks.values():
            stage_fsdp(chunk)            # FSDP2's collectives through host memory (no-op without FSDP2)
    return RankModel(rank, stage, replica, tp_rank, device, mesh, chunks,
                     TiedCopies(plan, spec.model, rank, chunks, staged=shared.tied), shared)
