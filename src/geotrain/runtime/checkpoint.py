"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout under RUN_DIR/checkpoints/:
  step_00000010/      a complete checkpoint (DCP shards + .metadata + loader_*.json)
  step_00000020.tmp/  a save in progress -- never read; removed by the next save
  latest              the name of the newest complete checkpoint (replaced atomically)

Every rank writes its shards into the .tmp directory; only after the collective save and a
barrier does rank 0 rename it and then repoint `latest` (write + os.replace), so a run killed
at any moment during a save still has the previous checkpoint.

State keys are prefixed by the physical stage (`stage1.model...`), so the stages' optimizer
param_groups never collide; the replicas of one stage share keys (replicated tensors are
written once, FSDP2 DTensor shards are assembled). ZeRO-1 optimizer partitions are per replica.
Scalars (step, loss scale) are tensors; only the loader state is JSON -- nothing is unpickled
from another process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from geotrain.runtime.scaler import GlobalLossScaler


class Checkpointer:
    def __init__(self, root: Path, stage: int, replica: int, chunks: dict[int, nn.Module],
                 optimizer: torch.optim.Optimizer, scaler: GlobalLossScaler):
        self.root, self.stage, self.replica = Path(root), stage, replica
        self.container = nn.ModuleDict({f"v{v}": m for v, m in sorted(chunks.items())})
        self.optimizer, self.scaler = optimizer, scaler
        self.zero1 = optimizer.__class__.__name__ == "ZeroRedundancyOptimizer"

    # -- state -----------------------------------------------------------------------------
    def _state(self, step: int) -> dict:
        from torch.distributed.checkpoint.state_dict import _init_optim_state, get_model_state_dict, get_state_dict

        if self.zero1:
            msd = get_model_state_dict(self.container)
            inner = self.optimizer.optim
            _init_optim_state(inner)
            osd = inner.state_dict()
            per_replica_optim = {"optim": osd}
            shared = {"model": msd}
        else:
            msd, osd = get_state_dict(self.container, self.optimizer)
            per_replica_optim = {}
            shared = {"model": msd, "optim": osd}
        mine = {"step": torch.tensor(step, dtype=torch.int64),
                "scale": torch.tensor(self.scaler.scale, dtype=torch.float64),
                "growth": torch.tensor(self.scaler.growth_tracker, dtype=torch.int64), **per_replica_optim}
        return {f"stage{self.stage}": shared, f"stage{self.stage}_replica{self.replica}": mine}

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, loader_state: dict | None = None) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        rank = dist.get_rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        dcp.save(self._state(step), checkpoint_id=str(tmp))
        if loader_state is not None:
            (tmp / f"loader_stage{self.stage}_replica{self.replica}.json").write_text(json.dumps(loader_state))
        dist.barrier()
        if rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            pointer = self.root / "latest.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / "latest")
            self._prune(keep=2)
        dist.barrier()
        return final

    def _prune(self, keep: int) -> None:
        done = sorted(p for p in self.root.glob("step_*") if not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- load --------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / ".metadata").exists() else None

    def load(self, path: Path) -> tuple[int, dict | None]:
        """Load a checkpoint into the model, optimizer and scaler; returns (step, loader state)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = self._state(0)
        dcp.load(state, checkpoint_id=str(path))
        shared = state[f"stage{self.stage}"]
        mine = state[f"stage{self.stage}_replica{self.replica}"]
        if self.zero1:
            set_model_state_dict(self.container, shared["model"])
            self.optimizer.optim.load_state_dict(mine["optim"])
        else:
            set_state_dict(self.container, self.optimizer, model_state_dict=shared["model"],
                           optim_state_dict=shared["optim"])
        self.scaler.scale = float(mine["scale"])
        self.scaler.growth_tracker = int(mine["growth"])
        loader_file = path / f"loader_stage{self.stage}_replica{self.replica}.json"
        loader = json.loads(loader_file.read_text()) if loader_file.exists() else None
        return int(mine["step"]), loader
