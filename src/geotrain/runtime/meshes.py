"""The device mesh a rank trains on, its other process groups, and how a checkpoint names its
tensor-parallel layout."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from geotrain.errors import GeotrainError


def tp_code(plan) -> int:
    """The tp a checkpoint's layout records (pp, dp, tp: three numbers in every checkpoint): the
    plan's, or for stages of different tp a negative code of them (never a plain tp), so a resume
    maps per-rank RNG states back only onto the same per-stage tps."""
    if not plan.mixed_tp:
        return plan.tp
    return -(zlib.crc32(",".join(map(str, plan.stage_tps)).encode()) + 1)


def stage_mesh(device_type: str, plan, stage: int) -> DeviceMesh:
    """This rank's device mesh, whose "dp" and "tp" slices FSDP2 and TP use (they must be slices of
    one mesh to compose). One tp: one (pp, dp, tp) mesh holding the plan's rank table (stage-major,
    or a region plan's pipeline-major numbering), so its "dp" slices are each stage's replicas
    whatever the numbering. Stages of different tp: one (dp, tp_s) mesh per stage over that
    stage's ranks. Creating a mesh creates its process groups, which every rank must join (also
    for a mesh it is not in: DeviceMesh then holds no coordinate for it), so every rank builds
    every stage's mesh, in stage order, and keeps its own. Expert parallelism (plan.ep > 1) splits
    "dp" into ("dp_rep", "ep"), flattened back into "dp" for FSDP2 and the DP reduction."""
    ep = getattr(plan, "ep", 1)
    if ep > 1:
        if plan.mixed_tp:
            raise GeotrainError("expert parallelism needs one tp for every stage")
        # dp = dp_rep x ep: ep consecutive replicas of a stage (inside its DC) split the experts
        table = torch.tensor(plan.rank_table, dtype=torch.int64)
        pp, dp, tp = table.shape
        mesh = DeviceMesh(device_type, table.reshape(pp, dp // ep, ep, tp), mesh_dim_names=("pp", "dp_rep", "ep", "tp"))
        mesh["dp_rep", "ep"]._flatten("dp")
        return mesh
    if not plan.mixed_tp:
        return DeviceMesh(device_type, torch.tensor(plan.rank_table, dtype=torch.int64),
                          mesh_dim_names=("pp", "dp", "tp"))
    meshes = [DeviceMesh(device_type, torch.tensor(plan.rank_table[s], dtype=torch.int64),
                         mesh_dim_names=("dp", "tp")) for s in range(plan.pp)]
    return meshes[stage]


_REUSED: dict[str, tuple[object, list[list[int]], list]] = {}   # site -> (world, member lists, groups)


def reused_groups(site: str, member_lists: list[list[int]]) -> list:
    """`dist.new_group` for each of `member_lists`, or the groups `site` made the last time it asked for
    the same lists in the same world: a launch that runs several cases (the tests, validate-sim) built
    every case's groups anew, ~1 s of gloo connections per case on 2 cores. Collective like new_group:
    every rank asks with the same lists in the same order, so every rank reuses alike. One cache per
    site: two parts of one case never share a group (their operations could interleave)."""
    world = dist.group.WORLD
    last = _REUSED.get(site)
    if last is not None and last[0] is world and last[1] == member_lists:
        return last[2]
    groups = [dist.new_group(m) for m in member_lists]
    _REUSED[site] = (world, [list(m) for m in member_lists], groups)
    return groups
