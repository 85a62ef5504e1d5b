"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout under RUN_DIR/checkpoints/:
  step_00000010/      a complete checkpoint (DCP shards + .metadata + loader_*.json)
  step_00000020.tmp/  a save in progress -- never read; removed by the next save
  latest              the name of the newest complete checkpoint (replaced atomically)

Every rank writes its shards into the .tmp directory; only after the collective save and a
barrier does rank 0 rename it and then repoint `latest` (write + os.replace), so a run killed
at any moment during a save still has the previous checkpoint.

State keys do not depend on the layout: parameters and their optimizer state are keyed by the
plain model's names (`model.units.7.attn.wq.weight`, `optim.state.units.7.attn.wq.weight.exp_avg`;
`units.N` is the global unit index, see models.llama.UnitStack), whatever stage, virtual chunk,
replica or shard holds them. DCP records each tensor's global shape and the pieces every rank
wrote, so a checkpoint saved under one pp split, dp and sharding (replicate, zero1, zero2, zero3,
tp) loads into any other (`--resume-from`): each rank asks only for the names (and, for FSDP2 and
TP DTensors, the slices) it now holds. ZeRO-1 ranks save and load only the parameters their
partition owns, by name, so a new dp regroups them too. Step, loss scale and layout are
replicated scalars; the RNG state is per rank (restored on the same layout, else rank 0's, which
every rank starts from). Only tensors are stored -- DCP unpickles non-tensor values, and nothing
from another process is unpickled -- and the loader state is JSON.
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
                 optimizer: torch.optim.Optimizer, scaler: GlobalLossScaler, layout: tuple[int, ...] = ()):
        self.root, self.stage, self.replica = Path(root), stage, replica
        self.layout = tuple(layout)               # (pp, dp, tp): decides whether per-rank RNG states map back
        self.container = nn.ModuleDict({f"v{v}": m for v, m in sorted(chunks.items())})
        self.optimizer, self.scaler = optimizer, scaler
        self.zero1 = optimizer.__class__.__name__ == "ZeroRedundancyOptimizer"

    # -- state -----------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        """Container name (`v1.units.7.attn.wq.weight`) -> plain model name (`units.7.attn.wq.weight`).
        The `vN.` prefix only numbers this rank's virtual chunks; unit indices are already global."""
        return {name: name.split(".", 1)[1] for name, _ in self.container.named_parameters()}

    def _zero1_state(self) -> dict[str, dict]:
        """This replica's ZeRO-1 partition of the optimizer state, keyed by plain model name."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        inner = self.optimizer.optim
        _init_optim_state(inner)
        plain = self._names()
        by_param = {p: plain[n] for n, p in self.container.named_parameters()}
        return {by_param[p]: inner.state[p] for g in inner.param_groups for p in g["params"] if p in inner.state}

    def _state(self, step: int) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        plain = self._names()
        if self.zero1:
            msd, ostate = get_model_state_dict(self.container), self._zero1_state()
        else:
            msd, osd = get_state_dict(self.container, self.optimizer)
            ostate = {plain[k]: v for k, v in osd["state"].items()}
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"model": {plain[k]: v for k, v in msd.items()},
                "optim": {"state": ostate},
                "train": {"step": torch.tensor(step, dtype=torch.int64),
                          "scale": torch.tensor(self.scaler.scale, dtype=torch.float64),
                          "growth": torch.tensor(self.scaler.growth_tracker, dtype=torch.int64),
                          "layout": torch.tensor(self.layout, dtype=torch.int64)},
                "rng": {f"rank{dist.get_rank()}": rng}}

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
        return latest_checkpoint(self.root)

    def load(self, path: Path) -> tuple[int, dict | None]:
        """Load a checkpoint -- of this layout or any other -- into the model, optimizer, scaler and
        RNG; returns (step, loader state)."""
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        from geotrain.errors import GeotrainError

        rank = dist.get_rank()
        state = self._state(0)
        rng = state.pop("rng")[f"rank{rank}"]
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        problem = _mismatch(state, saved)        # a one-line reason instead of DCP's traceback
        if problem:
            raise GeotrainError(f"checkpoint {path}: {problem} (written by another model or an older geotrain?)")
        dcp.load(state, checkpoint_id=str(path))
        plain = self._names()
        msd = {name: state["model"][p] for name, p in plain.items()}
        if self.zero1:
            set_model_state_dict(self.container, msd)   # the partition's optimizer state was loaded in place
        else:
            ostate = state["optim"]["state"]
            groups = get_optimizer_state_dict(self.container, self.optimizer)["param_groups"]  # live hyperparameters
            set_state_dict(self.container, self.optimizer, model_state_dict=msd,
                           optim_state_dict={"state": {n: ostate[p] for n, p in plain.items() if p in ostate},
                                             "param_groups": groups})
        # RNG streams are per rank: the same rank's on the same layout, else rank 0's.
        same = tuple(int(x) for x in state["train"]["layout"]) == self.layout and f"rng.rank{rank}.cpu" in saved
        source = f"rank{rank}" if same else "rank0"
        if all(f"rng.{source}.{d}" in saved for d in rng):
            dcp.load({"rng": {source: rng}}, checkpoint_id=str(path))
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"])
        train = state["train"]
        self.scaler.scale = float(train["scale"])
        self.scaler.growth_tracker = int(train["growth"])
        loader_file = path / f"loader_stage{self.stage}_replica{self.replica}.json"
        if not loader_file.exists():                 # another layout: every replica's stream state is the same
            loader_file = next(iter(sorted(path.glob("loader_*.json"))), loader_file)
        loader = json.loads(loader_file.read_text()) if loader_file.exists() else None
        return int(train["step"]), loader


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under RUN_DIR/checkpoints (this run's or another's), or None."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / ".metadata").exists() else None


def _mismatch(state: dict, saved: dict) -> str | None:
    """Why `saved` (DCP metadata: flat name -> storage metadata) cannot fill `state`, or None."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    for name, value in flat.items():
        meta = saved.get(name)
        if meta is None:
            return f"it holds no {name}"
        shape = tuple(getattr(meta, "size", ()))
        if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            return f"{name} has shape {list(shape)}, this run's model needs {list(value.shape)}"
    return None
