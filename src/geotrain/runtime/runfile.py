"""The run-config file: what the launcher hands every rank (RUN_DIR/logs/run_config.json).

A versioned envelope around the RunConfig cases, validated by pydantic on the way in (types of
every field, no unknown keys), so a file from another geotrain version, or not a run config at
all, is a one-line error instead of a TypeError deep in a rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from geotrain.errors import GeotrainError
from geotrain.runtime.train_config import RunConfig

RUN_CONFIG_FORMAT, RUN_CONFIG_VERSION = "geotrain-run-config", 1
_FIELDS = {f.name for f in fields(RunConfig)}


class RunConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["geotrain-run-config"]
    version: Literal[1]
    cases: list[RunConfig]


def write_run_config(path: Path, cases: list[RunConfig]) -> None:
    doc = {"format": RUN_CONFIG_FORMAT, "version": RUN_CONFIG_VERSION, "cases": [asdict(c) for c in cases]}
    Path(path).write_text(json.dumps(doc, indent=1))


def read_run_config(path: Path) -> list[RunConfig]:
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
    for i, case in enumerate(doc.get("cases") or []):
        unknown = sorted(set(case) - _FIELDS) if isinstance(case, dict) else []
        if unknown:
            raise GeotrainError(f"{path}: cases[{i}].{unknown[0]}: unknown key")
    try:
        return RunConfigFile.model_validate(doc).cases
    except ValidationError as e:
        err = e.errors()[0]
        raise GeotrainError(f"{path}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None


OUTAGE_LIMIT_ENV = "GEOTRAIN_OUTAGE_LIMIT_S"   # --outage-limit, for every rank (our launcher's and torchrun's)
DEFAULT_OUTAGE_LIMIT_S = 300.0


def outage_limit_s() -> float:
    """How long a cross-DC wait may last before its rank fails: --outage-limit, else the default."""
    try:
        return float(os.environ.get(OUTAGE_LIMIT_ENV, DEFAULT_OUTAGE_LIMIT_S))
    except ValueError:
        raise GeotrainError(f"{OUTAGE_LIMIT_ENV} must be a number of seconds") from None
