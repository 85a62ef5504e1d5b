"""The run file: what the launcher hands every rank (RUN_DIR/logs/run_config.json).

A versioned envelope around the run's cases, each its TrainConfig and its plan as a plan file holds
it (the plan and the whole experiment, `layout.plan.plan_document`), so a rank reads Spec + Plan
objects from it and never a TOML, never the planner. Validated on the way in (pydantic: types of
every field, no unknown keys): a file from another geotrain version, or not a run file at all, is a
one-line error instead of a TypeError deep in a rank.

Also the checkpoint series' directory layout (runtime.checkpoint's docstring): the launcher checks a
--resume against it before any rank starts, so it lives here, without torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from geotrain.errors import GeotrainError
from geotrain.layout.plan import plan_document, plan_from_document, plan_spec
from geotrain.runtime.train_config import RunCase, TrainConfig

RUN_CONFIG_FORMAT, RUN_CONFIG_VERSION = "geotrain-run-config", 2


class _Case(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: TrainConfig
    plan_file: dict[str, Any]


class RunFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["geotrain-run-config"]
    version: Literal[2]
    cases: list[_Case]


def write_run_config(path: Path, cases: list[RunCase]) -> None:
    doc = {"format": RUN_CONFIG_FORMAT, "version": RUN_CONFIG_VERSION,
           "cases": [{"config": c.config.model_dump(mode="json"), "plan_file": plan_document(c.plan, spec=c.spec)}
                     for c in cases]}
    Path(path).write_text(json.dumps(doc, indent=1))


def read_run_config(path: Path) -> list[RunCase]:
    """The cases in `path`; a GeotrainError naming the file and the problem otherwise."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GeotrainError(f"{path}: cannot read the run config ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != RUN_CONFIG_FORMAT:
        raise GeotrainError(f"{path}: not a geotrain run config")
    if doc.get("version") != RUN_CONFIG_VERSION:
        raise GeotrainError(f"{path}: run config version {doc.get('version')!r}; this geotrain reads version "
                            f"{RUN_CONFIG_VERSION}")
    try:
        parsed = RunFile.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise GeotrainError(f"{path}: {where}: {msg}") from None
    cases = []
    for i, case in enumerate(parsed.cases):
        where = f"{path} (cases[{i}])"
        if not case.plan_file.get("resolved_spec"):
            raise GeotrainError(f"{where}: the plan carries no experiment (resolved_spec)")
        cases.append(RunCase(plan_spec(case.plan_file, where), plan_from_document(case.plan_file, where), case.config))
    return cases


def last_checkpoint_every(run_dir: Path) -> int | None:
    """The --checkpoint-every an interrupted run was started with (its run file), if it can be told."""
    try:
        return read_run_config(Path(run_dir) / "logs" / "run_config.json")[0].config.checkpoint_every
    except (GeotrainError, IndexError):
        return None        # an older run's file, or none


# ----------------------------------------------------------------------------- the checkpoint series
STEP_DIR = re.compile(r"^step_(\d{8})(?:\.r(\d+))?$")


def step_dirs(root: Path) -> list[tuple[tuple[int, int], Path]]:
    """The committed checkpoint directories under `root`, sorted by (step, revision)."""
    out = []
    for p in root.glob("step_*") if root.is_dir() else ():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append(((int(m.group(1)), int(m.group(2) or 1)), p))
    return sorted(out)


def start_new_series(root: Path) -> Path | None:
    """Move an earlier run's checkpoints (if any) to a sibling checkpoints.run<N>/; returns where."""
    if not root.is_dir() or not any(root.iterdir()):
        return None
    n = 1
    while (aside := root.with_name(f"{root.name}.run{n}")).exists():
        n += 1
    os.rename(root, aside)
    return aside


def _incomplete(path: Path) -> str | None:
    """Why the checkpoint directory `path` cannot be loaded as it is, or None."""
    meta = path / ".metadata"
    if not meta.is_file() or meta.stat().st_size == 0:
        return f"{path.name} is incomplete (its .metadata is missing)"
    if not any(path.glob("*.distcp")):
        return f"{path.name} is incomplete (it holds no shard files)"
    return None


def resume_points(root: Path) -> tuple[list[Path], str | None]:
    """The complete checkpoints under `root`, the one to resume from first: the one `latest` names
    when it is complete, then the others newest first (a latest one broken after its save -- its
    .metadata deleted, a disk filled -- leaves the one before it). Also why `latest` itself is not
    first (None when it is). A GeotrainError when none is complete, saying what is missing."""
    pointer = root / "latest"
    none = f"--resume: no complete checkpoint in {root}"
    if not root.is_dir():
        raise GeotrainError(f"{none}: the directory does not exist (nothing was saved here)")
    name = pointer.read_text().strip() if pointer.is_file() else ""
    named = root / name if name and "/" not in name and (root / name).is_dir() else None
    if not pointer.is_file():
        why = f"{pointer.name} is missing (no save was completed)"
    elif named is None:
        why = f"{pointer.name} names {name!r}, which is not a directory there"
    else:
        why = _incomplete(named)
    complete = [p for _, p in reversed(step_dirs(root)) if p != named and _incomplete(p) is None]
    if why is None:
        complete.insert(0, named)
    if not complete:
        raise GeotrainError(f"{none}: {why}")
    return complete, why


def resume_point(root: Path) -> Path:
    """The newest complete checkpoint to resume from (`resume_points`), or a GeotrainError."""
    return resume_points(root)[0][0]


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Rename a finished save to a fresh name and point `latest` at it; nothing is removed here."""
    final = root / f"step_{step:08d}"
    rev = 1
    while final.exists():
        rev += 1
        final = root / f"step_{step:08d}.r{rev}"
    os.rename(tmp, final)
    pointer = root / "latest.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / "latest")
    return final


def prune(root: Path, keep: int) -> None:
    """Remove all but the `keep` highest steps of the series -- never the one `latest` names."""
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    done = step_dirs(root)
    for _key, old in done[:-keep] if keep > 0 else done:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)


def check_resumable(out: Path, every: int | None) -> int | None:
    """`train --resume`, before any rank starts: RUN_DIR must hold a complete checkpoint, else the run
    would silently start over (and truncate its losses). Returns the interrupted run's
    --checkpoint-every unless a new one is given."""
    try:
        resume_point(out / "checkpoints")        # the newest complete one (the ranks say which, if not latest)
    except GeotrainError as e:
        raise GeotrainError(f"{e} (train with --checkpoint-every N, or job.checkpoint_every, to save some)") from None
    return last_checkpoint_every(out) if every is None else every


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under RUN_DIR/checkpoints (this run's or another's), or None."""
    try:
        return resume_point(Path(root))
    except GeotrainError:
        return None
