"""Reading TOML specs into validated objects, with one-line errors naming file and field.

Three kinds of file:
  * cluster   -- top-level `datacenters`, `wan_links`, optional `gpu_types`;
  * model     -- the shape fields, or `preset = "llama2-7b"` plus overrides;
  * experiment (job) -- a `[job]` table plus `cluster` and `model`, each either a path
    (relative to the file), a preset name (models), or an inline table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ValidationError

from geotrain.config.cluster import Cluster
from geotrain.config.job import JobSpec
from geotrain.config.model import ModelSpec
from geotrain.errors import SpecError

EXPERIMENT_KEYS = {"name", "cluster", "model", "job", "bubbletea"}


@dataclass(frozen=True)
class Spec:
    """A complete experiment: where (cluster), what (model) and how (job)."""

    name: str
    cluster: Cluster
    model: ModelSpec
    job: JobSpec
    path: Path | None = None
    bubbletea: dict[str, Any] | None = None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise SpecError(str(path), "", "file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(str(path), "", f"not valid TOML ({e})") from None


def _loc(parts: tuple[Any, ...]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _validate(cls: type[BaseModel], data: Any, file: str, prefix: str = "") -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = _loc(err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required field is missing"
        # Errors raised by our own validators carry "field: reason".
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
            head, sep, tail = msg.partition(": ")
            if sep and " " not in head:
                field, msg = head, tail
        full = ".".join(p for p in (prefix, field) if p)
        raise SpecError(file, full or "(top level)", msg) from None


def _model_from_dict(data: dict[str, Any], file: str, prefix: str = "") -> ModelSpec:
    from geotrain.models.presets import PRESETS

    data = dict(data)
    preset = data.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise SpecError(file, ".".join(p for p in (prefix, "preset") if p),
                            f"unknown model preset {preset!r} (known: {', '.join(PRESETS)})")
        data = {**PRESETS[preset].model_dump(), **data}
    return _validate(ModelSpec, data, file, prefix)


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    return _validate(Cluster, _read_toml(path), str(path))


def load_model(ref: str | Path, base: Path | None = None) -> ModelSpec:
    """A model from a preset name or a TOML file path."""
    from geotrain.models.presets import PRESETS

    if str(ref) in PRESETS:
        return PRESETS[str(ref)]
    path = Path(ref) if base is None else base / ref
    if path.suffix != ".toml" and not path.exists():
        raise SpecError(str(ref), "", f"not a model preset ({', '.join(PRESETS)}) nor a file")
    return _model_from_dict(_read_toml(path), str(path))


def load_spec(path: str | Path) -> Spec:
    """Load an experiment file (cluster + model + job)."""
    path = Path(path)
    data = _read_toml(path)
    file = str(path)
    if "job" not in data:
        raise SpecError(file, "job", "required table is missing (is this a cluster or model file?)")
    for key in data:
        if key not in EXPERIMENT_KEYS:
            raise SpecError(file, key, "unknown key")
    base = path.parent

    c = data.get("cluster")
    if c is None:
        raise SpecError(file, "cluster", "required field is missing")
    if isinstance(c, dict):
        cluster = _validate(Cluster, c, file, "cluster")
    elif isinstance(c, str):
        cluster = load_cluster(base / c)
    else:
        raise SpecError(file, "cluster", "must be a path or a table")

    m = data.get("model")
    if m is None:
        raise SpecError(file, "model", "required field is missing")
    if isinstance(m, dict):
        model = _model_from_dict(m, file, "model")
    elif isinstance(m, str):
        model = load_model(m, base)
    else:
        raise SpecError(file, "model", "must be a preset name, a path or a table")

    if not isinstance(data["job"], dict):
        raise SpecError(file, "job", "must be a table")
    job = _validate(JobSpec, data["job"], file, "job")
    bt = data.get("bubbletea")
    if bt is not None and not isinstance(bt, dict):
        raise SpecError(file, "bubbletea", "must be a table")
    spec = Spec(name=str(data.get("name", path.stem)), cluster=cluster, model=model, job=job,
                path=path, bubbletea=bt)
    check_fits(spec)
    return spec


def check_fits(spec: Spec) -> None:
    """Refuse a model whose training state cannot fit on the whole cluster even fully sharded.

    Mixed-precision Adam keeps ~16 bytes per parameter (weights, grads, fp32 master and two
    moments); fp32 Adam also 16; SGD 8 (fp32) -- before any activation."""
    from geotrain.cost.memory import training_state_bytes_per_param

    per_param = training_state_bytes_per_param(spec.job.precision, spec.job.optimizer)
    need = spec.model.param_count() * per_param
    have = spec.cluster.total_memory_bytes
    if need > have:
        raise SpecError(
            str(spec.path), "model",
            f"{spec.model.name} needs {need / 2**40:.1f} TiB of training state "
            f"({per_param} B/param) but the whole cluster has {have / 2**40:.2f} TiB of GPU memory",
        )


def validate_file(path: str | Path) -> str:
    """Validate any spec file; return a one-line summary. Raises SpecError."""
    path = Path(path)
    data = _read_toml(path)
    if "job" in data:
        s = load_spec(path)
        return (f"{path}: experiment {s.name!r}: {s.model.name} ({s.model.param_count() / 1e9:.2f}B params) "
                f"on {s.cluster.name} ({len(s.cluster.datacenters)} DCs, {s.cluster.total_gpus} GPUs)")
    if "datacenters" in data:
        c = load_cluster(path)
        return (f"{path}: cluster {c.name!r}: {len(c.datacenters)} DCs, {c.total_gpus} GPUs, "
                f"{len(c.wan_links)} WAN links")
    if "layers" in data or "preset" in data:
        m = _model_from_dict(data, str(path))
        return f"{path}: model {m.name!r}: {m.param_count() / 1e9:.3f}B params"
    raise SpecError(str(path), "", "not a cluster (datacenters), model (layers/preset) or experiment (job) spec")
