"""The run file: what the launcher hands every rank (RUN_DIR/logs/run_config.json).

A versioned envelope around the run's cases, each its TrainConfig and its plan as a plan file holds
it (the plan and the whole experiment, `layout.plan.plan_document`), so a rank reads Spec + Plan
objects from it and never a TOML, never the planner. Validated on the way in (pydantic: types of
every field, no unknown keys): a file from another geotrain version, or not a run file at all, is a
one-line error instead of a TypeError deep in a rank.
"""

from __future__ import annotations

import json
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
