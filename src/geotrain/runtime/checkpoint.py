"""Atomic distributed checkpoints with torch.distributed.checkpoint (DCP) that never destroy work.

Layout under RUN_DIR/checkpoints/ (one run's series of checkpoints):
  step_00000010/      a complete checkpoint (DCP shards + .metadata + loader_*.json)
  step_00000010.r2/   the same step saved again (a resumed run redoing it): a new name, never a replace
  step_00000020.tmp/  a save in progress -- never read; removed by the next save
  latest              the name of the newest complete checkpoint (replaced atomically)

A save is renamed into place and `latest` repointed before anything is pruned, so a run killed at
any moment keeps a complete checkpoint; a fresh run moves an earlier series to
checkpoints.run<N>/; `--resume` falls back past an incomplete latest, saying so. State is keyed by
the plain model's parameter names, never by stage, rank or shard, so DCP reshards a checkpoint
onto any other layout (`--resume-from`); only tensors are stored and the loader state is JSON.
The series' file operations (commit, prune, resume points) are runfile.py's (torch-free).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from geotrain.errors import GeotrainError
from geotrain.runtime.runfile import commit, latest_checkpoint, prune, resume_points, start_new_series
from geotrain.runtime.scaler import GlobalLossScaler
from geotrain.torch_compat import flatten_state_dict

PROBE = ".shared-probe"


def _first_cause(e: BaseException) -> str:
    """One line for a failed load: DCP wraps each rank's exception in a CheckpointException."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


class Checkpointer:
    """One rank's saves and loads. Every rank writes its shards into the .tmp directory; after the
    collective save and a barrier rank 0 commits (`commit`, then `prune`). Keys: `model.units.N...`
    and `optim.state.units.N...` (N the global unit index), so each rank asks only for the names
    (and DTensor slices) it now holds; ZeRO-1 ranks save and load only their partition's names.
    Step, loss scale and layout are replicated scalars; the RNG state is per rank, restored on the
    same layout, else rank 0's. The directory must be shared by every rank (checked at start)."""

    def __init__(self, root: Path, stage: int, replica: int, chunks: dict[int, nn.Module],
                 optimizer: torch.optim.Optimizer, scaler: GlobalLossScaler, layout: tuple[int, ...] = (),
                 outer=None):
        self.root, self.stage, self.replica = Path(root), stage, replica
        self.outer = outer                        # DiLoCo's state (runtime.diloco): saved under "outer"
        self.layout = tuple(layout)               # (pp, dp, tp): decides whether per-rank RNG states map back
        self.container = nn.ModuleDict({f"v{v}": m for v, m in sorted(chunks.items())})
        self.optimizer, self.scaler = optimizer, scaler
        self.zero1 = optimizer.__class__.__name__ == "ZeroRedundancyOptimizer"
        self.notes: list[str] = []                # lines for the console: a resume that fell back (begin)

    # -- state -----------------------------------------------------------------------------
    def _names(self, aliases: bool = False) -> dict[str, str]:
        """Container name (`v1.units.7.attn.wq.weight`) -> plain model name (`units.7.attn.wq.weight`).
        The `vN.` prefix only numbers this rank's virtual chunks; unit indices are already global.
        `aliases`: a tied matrix under both its names too (a model state dict holds both; the
        optimizer's, one per Parameter)."""
        named = self.container.named_parameters(remove_duplicate=not aliases)
        return {name: name.split(".", 1)[1] for name, _ in named}

    def _aliases(self) -> dict[str, str]:
        """Plain name -> the plain name it shares a Parameter with (tied embeddings in one chunk)."""
        first: dict[int, str] = {}
        out = {}
        for name, p in self.container.named_parameters(remove_duplicate=False):
            plain = name.split(".", 1)[1]
            if id(p) in first:
                out[plain] = first[id(p)]
            else:
                first[id(p)] = plain
        return out

    def _zero1_state(self) -> dict[str, dict]:
        """This replica's ZeRO-1 partition of the optimizer state, keyed by plain model name."""
        inner = self.optimizer.optim
        _init_optim_state(inner)
        plain = self._names()
        by_param = {p: plain[n] for n, p in self.container.named_parameters()}
        return {by_param[p]: inner.state[p] for g in inner.param_groups for p in g["params"] if p in inner.state}

    def _state(self, step: int) -> dict:
        plain = self._names()
        if self.zero1:
            msd, ostate = get_model_state_dict(self.container), self._zero1_state()
        else:
            msd, osd = get_state_dict(self.container, self.optimizer)
            ostate = {plain[k]: v for k, v in osd["state"].items()}
        for alias, name in self._aliases().items():   # a tied matrix: its state under both names, so a
            if name in ostate:                          # layout holding two copies resumes both alike
                ostate.setdefault(alias, ostate[name])
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        every = self._names(aliases=True)
        return {"model": {every[k]: v for k, v in msd.items()},
                "optim": {"state": ostate},
                "train": {"step": torch.tensor(step, dtype=torch.int64),
                          "scale": torch.tensor(self.scaler.scale, dtype=torch.float64),
                          "growth": torch.tensor(self.scaler.growth_tracker, dtype=torch.int64),
                          "layout": torch.tensor(self.layout, dtype=torch.int64)},
                "rng": {f"rank{dist.get_rank()}": rng},
                **({"outer": self.outer.state_dict()} if self.outer is not None else {})}

    # -- start -------------------------------------------------------------------------------
    def begin(self, resume: bool, saving: bool, source: Path | None = None) -> tuple[int, dict | None]:
        """Collective, before training: resume from `latest` of this run (`resume`) or of another
        run's checkpoints (`source`, --resume-from) -- or a one-line error naming what is missing --
        else start a new series; check the directory is shared when anything is saved or loaded.
        Returns (step to start from, loader state)."""
        rank = dist.get_rank()
        if source is not None and Path(source).resolve() == self.root.resolve():
            resume, source = True, None
        if rank == 0 and not resume:
            aside = start_new_series(self.root)
            if aside is not None:
                print(f"geotrain train: {self.root} held an earlier run's checkpoints; kept as {aside.name}/, "
                      f"this run starts a new series", flush=True)
        if saving or resume:
            self._check_shared()
        if not resume and source is None:
            return 0, None
        flag = "--resume" if resume else "--resume-from"
        try:
            paths, why = resume_points(self.root if resume else Path(source))
        except GeotrainError as e:
            raise GeotrainError(str(e).replace("--resume:", f"{flag}:", 1)) from None
        for i, path in enumerate(paths):     # every rank tries the same list: a failed load fails everywhere
            if why is not None:
                self.notes.append(f"geotrain train: {flag}: {why}; resuming from {path.name}, the newest complete "
                                  "checkpoint")
            try:
                return self.load(path)
            except (CheckpointException, Exception) as e:  # noqa: BLE001 -- any unreadable file: one line
                if i + 1 == len(paths) or (isinstance(e, GeotrainError) and "written by another model" in str(e)):
                    if isinstance(e, GeotrainError):
                        raise
                    raise GeotrainError(f"{flag}: checkpoint {path} cannot be loaded ({_first_cause(e)})") from None
                why = f"{path.name} cannot be loaded ({_first_cause(e)})"
        raise GeotrainError(f"{flag}: no checkpoint to resume from")     # (resume_points lists at least one)

    def _check_shared(self) -> None:
        """Every rank must see the file rank 0 writes into the checkpoint directory."""
        rank = dist.get_rank()
        nonce = torch.zeros(2, dtype=torch.int64)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            nonce[0], nonce[1] = secrets.randbits(62), os.getpid()
            (self.root / PROBE).write_text(f"{int(nonce[0])}\n")
        dist.broadcast(nonce, src=0)
        try:
            seen = int((self.root / PROBE).read_text().strip()) == int(nonce[0])
        except (OSError, ValueError):
            seen = False
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, torch.tensor([0 if seen else 1], dtype=torch.int64))
        dist.barrier()
        if rank == 0:
            (self.root / PROBE).unlink(missing_ok=True)
        blind = [r for r, f in enumerate(flags) if int(f)]
        if blind:
            raise GeotrainError(f"checkpoints need a directory every rank shares, but rank(s) "
                                f"{', '.join(map(str, blind))} cannot see rank 0's files in {self.root}; "
                                f"use a shared filesystem for RUN_DIR or --checkpoint-every 0")

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, loader_state: dict | None = None, keep: int = 2) -> Path:
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
        final = self.root / f"step_{step:08d}"
        if rank == 0:
            final = commit(self.root, tmp, step)
            prune(self.root, keep)
        dist.barrier()
        return final

    # -- load --------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        return latest_checkpoint(self.root)

    def load(self, path: Path) -> tuple[int, dict | None]:
        """Load a checkpoint -- of this layout or any other -- into the model, optimizer, scaler and
        RNG; returns (step, loader state)."""
        rank = dist.get_rank()
        state = self._state(0)
        rng = state.pop("rng")[f"rank{rank}"]
        outer = state.pop("outer", None)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        problem = _mismatch(state, saved)        # a one-line reason instead of DCP's traceback
        if problem:
            raise GeotrainError(f"checkpoint {path}: {problem} (written by another model or an older geotrain?)")
        dcp.load(state, checkpoint_id=str(path))
        plain = self._names()
        msd = {name: state["model"][p] for name, p in self._names(aliases=True).items()}
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
        if outer is not None:      # DiLoCo's outer state, or (a checkpoint of a run without it) the model's
            if any(k.startswith("outer.") for k in saved):
                dcp.load({"outer": outer}, checkpoint_id=str(path))
                self.outer.loaded(outer)
            else:
                self.outer.restart_from_params()
        train = state["train"]
        self.scaler.scale = float(train["scale"])
        self.scaler.growth_tracker = int(train["growth"])
        loader_file = path / f"loader_stage{self.stage}_replica{self.replica}.json"
        if not loader_file.exists():                 # another layout: every replica's stream state is the same
            loader_file = next(iter(sorted(path.glob("loader_*.json"))), loader_file)
        loader = json.loads(loader_file.read_text()) if loader_file.exists() else None
        return int(train["step"]), loader


def _mismatch(state: dict, saved: dict) -> str | None:
    """Why `saved` (DCP metadata: flat name -> storage metadata) cannot fill `state`, or None."""
    flat, _ = flatten_state_dict(state)
    for name, value in flat.items():
        meta = saved.get(name)
        if meta is None:
            return f"it holds no {name}"
        shape = tuple(getattr(meta, "size", ()))
        if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
            return f"{name} has shape {list(shape)}, this run's model needs {list(value.shape)}"
    return None
