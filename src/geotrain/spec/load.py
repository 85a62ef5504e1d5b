"""Reading TOML specs into validated objects, with one-line errors naming file and field.

Three kinds of file:
  * cluster   -- top-level `datacenters`, `wan_links`, optional `gpu_types`;
  * model     -- the shape fields, or `preset = "llama2-7b"` plus overrides;
  * experiment (job) -- a `[job]` table plus `cluster` and `model`, each either a path
    (relative to the file), a preset name (models), or an inline table.

Every problem is raised as one `SpecError(file, field, reason)`: the first error only, because a
user fixes one line at a time and a wall of pydantic output hides the one that matters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from geotrain.errors import SpecError
from geotrain.models.hf_files import HFWeightsError, check_tensor_names, has_weights
from geotrain.models.presets import PRESETS
from geotrain.spec.base import identifier_problem
from geotrain.spec.cluster import Cluster
from geotrain.spec.hf_config import HFConfigError, is_hf_dir, read_hf_config
from geotrain.spec.job import MAX_MICROBATCHES, JobSpec, training_state_bytes_per_param
from geotrain.spec.model import ModelSpec, tp_split_widths

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

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


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _read_toml(path: Path, file: str | None = None, field: str = "") -> dict[str, Any]:
    """Parse `path`. Problems opening it are reported against `file`/`field` (the spec that
    referred to it) when given, so "file not found" names the line the user must fix."""
    where = file if file is not None else str(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        reason = "file not found" if file is None else f"file not found: {path}"
        raise SpecError(where, field, reason) from None
    except IsADirectoryError:
        raise SpecError(where, field, f"is a directory, not a TOML file: {path}") from None
    except OSError as e:
        raise SpecError(where, field, f"cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        loc = f"line {m.group(1)}" if m else ""
        raise SpecError(str(path), loc, f"not valid TOML ({_one_line(e)})") from None
    except UnicodeDecodeError:
        raise SpecError(str(path), "", "not valid TOML (not UTF-8 text)") from None
    except RecursionError:
        raise SpecError(str(path), "", "nested too deeply to be a spec (arrays or tables inside each other "
                                       "thousands of levels deep)") from None


# Pydantic adds the member type of a union to an error's location (`micro_batch.constrained-int`);
# such parts are not keys the user wrote, so they are dropped.
_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|list|dict|tuple|constrained-\w+|[\w-]+\[.*\])$")


def _loc(parts: tuple[Any, ...]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _TYPE_TAG.match(str(p)):
            out += f".{p}" if out else str(p)
    return out


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _validate(cls: type[BaseModel], data: Any, file: str, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise SpecError(file, prefix or "(top level)", f"must be a table (got {type(data).__name__})")
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
        elif msg.startswith("Value error, "):
            # Our own validators say "field: reason" when the field is not the error's location.
            msg = msg[len("Value error, "):]
            head, sep, tail = msg.partition(": ")
            if sep and re.fullmatch(r"[\w.\[\]-]+", head):
                field, msg = _join(field, head), tail
        else:
            got = err.get("input")
            if isinstance(got, (str, int, float, bool)):
                msg += f" (got {_short(got)})"
            elif isinstance(got, (dict, list)):
                msg += f" (got a {'table' if isinstance(got, dict) else 'list'})"
        raise SpecError(file, _join(prefix, field) or "(top level)", _one_line(msg)) from None


def _short(value: Any) -> str:
    text = repr(value)
    if isinstance(value, bool):
        text = "true" if value else "false"
    return text if len(text) <= 60 else text[:57] + "..."


def _model_from_dict(data: dict[str, Any], file: str, prefix: str = "", default_name: str | None = None) -> ModelSpec:
    if not isinstance(data, dict):
        raise SpecError(file, prefix or "(top level)", "must be a table")
    data = dict(data)
    if "hf" in data:
        return _hf_model(data, file, prefix, default_name)
    preset = data.pop("preset", None)
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise SpecError(file, _join(prefix, "preset"),
                            f"unknown model preset {_short(preset)} (known: {', '.join(PRESETS)})")
        data = {**PRESETS[preset].fields_dict(), **data}
    elif default_name is not None and "name" not in data:
        data["name"] = default_name
    return _validate(ModelSpec, data, file, prefix)


# Keys a model table may set beside `hf`: everything else comes from the weights' config.json.
_HF_OVERRIDES = {"hf", "name", "seq_len", "allow_missing"}


def _hf_model(data: dict[str, Any], file: str, prefix: str, default_name: str | None) -> ModelSpec:
    """A model whose shape and weights come from a Hugging Face directory (`hf = "DIR"`, relative
    to the file naming it); `seq_len` may shorten the trained context."""
    ref = data["hf"]
    if not isinstance(ref, str) or not ref:
        raise SpecError(file, _join(prefix, "hf"), "must be the path of a Hugging Face model directory")
    extra = sorted(set(data) - _HF_OVERRIDES)
    if extra:
        raise SpecError(file, _join(prefix, extra[0]), "the shape comes from the hf directory's config.json; "
                                                       "only name, seq_len and allow_missing may be set beside hf")
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = Path(file).parent / path
    if not is_hf_dir(path):
        raise SpecError(file, _join(prefix, "hf"), f"{path}: not a directory with a config.json")
    try:
        shape = read_hf_config(path)
    except HFConfigError as e:
        field, _, reason = str(e).partition(": ")
        raise SpecError(str(path / "config.json"), field, reason) from None
    seq_len = data.get("seq_len", shape["seq_len"])
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > shape["seq_len"]:
        raise SpecError(file, _join(prefix, "seq_len"), f"{seq_len} is past the model's max_position_embeddings "
                                                        f"{shape['seq_len']}")
    name = data.get("name", default_name or path.name)
    fields = {**shape, "name": name, "seq_len": seq_len, "hf": str(path.resolve())}
    if "allow_missing" in data:
        fields["allow_missing"] = data["allow_missing"]
    model = _validate(ModelSpec, fields, file, prefix)
    if has_weights(path):   # their names against the model's, from the safetensors headers alone
        try:
            check_tensor_names(model.shape, path, model.tie_embeddings, model.allow_missing)
        except HFWeightsError as e:
            raise SpecError(file, _join(prefix, "hf"), str(e)) from None
    return model   # (a config.json alone plans and simulates; training then says what is missing)


def load_cluster(path: str | Path, *, referred_from: str | None = None, field: str = "") -> Cluster:
    path = Path(path)
    data = _read_toml(path, referred_from, field)
    if "name" not in data:
        data["name"] = path.stem
    return _validate(Cluster, data, str(path))


def load_model(ref: str | Path, base: Path | None = None, *, referred_from: str | None = None,
               field: str = "") -> ModelSpec:
    """A model from a preset name or a TOML file path (relative to `base` when given)."""
    if str(ref) in PRESETS:
        return ModelSpec(**PRESETS[str(ref)].fields_dict())
    path = Path(ref) if base is None else base / ref
    if path.is_dir():
        return _model_from_dict({"hf": str(path.resolve())}, referred_from or str(path), field)
    if path.suffix != ".toml" and not path.exists():
        raise SpecError(referred_from or str(ref), field,
                        f"{str(ref)!r} is neither a model preset ({', '.join(PRESETS)}) nor a file")
    return _model_from_dict(_read_toml(path, referred_from, field), str(path), default_name=path.stem)


def load_spec(path: str | Path) -> Spec:
    """Load an experiment file (cluster + model + job) and check the model can fit the cluster."""
    path = Path(path)
    data = _read_toml(path)
    file = str(path)
    if "job" not in data:
        raise SpecError(file, "job", "required table is missing (is this a cluster or model file?)")
    for key in data:
        if key not in EXPERIMENT_KEYS:
            raise SpecError(file, key, f"unknown key (expected: {', '.join(sorted(EXPERIMENT_KEYS))})")
    base = path.parent
    name = data.get("name", path.stem)
    if "name" in data and identifier_problem(name):      # (a default from the file name is the user's file name)
        raise SpecError(file, "name", identifier_problem(name))
    if not isinstance(name, str) or not name:
        raise SpecError(file, "name", "must be a non-empty string")

    c = data.get("cluster")
    if c is None:
        raise SpecError(file, "cluster", "required field is missing")
    if isinstance(c, dict):
        cluster = _validate(Cluster, {"name": name, **c}, file, "cluster")
    elif isinstance(c, str):
        cluster = load_cluster(base / c, referred_from=file, field="cluster")
    else:
        raise SpecError(file, "cluster", "must be a path or a table")

    m = data.get("model")
    if m is None:
        raise SpecError(file, "model", "required field is missing")
    if isinstance(m, dict):
        model = _model_from_dict(m, file, "model")
    elif isinstance(m, str):
        model = load_model(m, base, referred_from=file, field="model")
    else:
        raise SpecError(file, "model", "must be a preset name, a path or a table")

    if not isinstance(data["job"], dict):
        raise SpecError(file, "job", "must be a table")
    job = _validate(JobSpec, data["job"], file, "job")
    bt = data.get("bubbletea")
    if bt is not None and not isinstance(bt, dict):
        raise SpecError(file, "bubbletea", "must be a table")
    _check_data_path(job, path, file)
    spec = Spec(name=name, cluster=cluster, model=model, job=job, path=path, bubbletea=bt)
    check_shape(spec)
    check_fits(spec)
    return spec


def _check_data_path(job: JobSpec, path: Path, file: str) -> None:
    """`data` names files or folders for `geotrain train` (relative to the spec, like `cluster`);
    "stdlib" or nothing is the built-in corpus. A typo should fail here, not minutes into a launch."""
    for i, src in enumerate(job.data_sources or []):
        if src.path == "stdlib":            # the built-in corpus, mixed with the others
            continue
        p = Path(src.path).expanduser()
        if not ((path.parent / p).exists() or p.exists()):
            where = "job.data" if isinstance(job.data, str) else f"job.data[{i}].path"
            raise SpecError(file, where, f"no such file or directory: {src.path}")


def check_shape(spec: Spec) -> None:
    """Refuse pinned parallel degrees the model or cluster cannot have at all.

    Only what is wrong whatever the plan: per-DC placement is the planner's business."""
    job, model, cluster, file = spec.job, spec.model, spec.cluster, str(spec.path)
    if job.pp is not None and job.pp > model.num_units:
        raise SpecError(file, "job.pp", f"pp={job.pp} stages but {model.name} has only {model.num_units} "
                                        f"units to cut ({model.layers} layers + embedding + head)")
    tp = job.tp if isinstance(job.tp, int) else 1   # "auto": the planner picks among the tps that fit
    if tp > 1:
        widths = tp_split_widths(model)
        if any(n % job.tp for _, n in widths):
            raise SpecError(file, "job.tp", f"tp={job.tp} must divide "
                            + ", ".join(f"{what}={n}" for what, n in widths) + " (tensor parallelism splits them)")
        widest = max(dc.gpus_per_node for dc in cluster.datacenters)
        if job.tp > widest:
            raise SpecError(file, "job.tp", f"tp={job.tp} is wider than the largest node ({widest} GPUs); "
                                            "tensor parallelism stays inside a node")
    ep = job.ep if isinstance(job.ep, int) else 1
    if ep > 1:
        if not model.experts:
            raise SpecError(file, "job.ep", f"ep={ep}: model {model.name} has no experts (expert parallelism "
                                            "needs a mixture of experts)")
        if model.experts % ep or (job.dp is not None and job.dp % ep):
            raise SpecError(file, "job.ep", f"ep={ep} must divide the model's {model.experts} experts"
                                            + (f" and dp={job.dp}" if job.dp is not None else ""))
    need = (job.pp or 1) * (job.dp or 1) * tp
    if need > cluster.total_gpus:
        raise SpecError(file, "job", f"pp x dp x tp = {need} GPUs but the cluster has {cluster.total_gpus}")
    if isinstance(job.micro_batch, int):
        widest_dp = job.dp or max(1, cluster.total_gpus // ((job.pp or 1) * tp))
        fewest = -(-job.global_batch // (widest_dp * job.micro_batch))
        if fewest > MAX_MICROBATCHES:
            raise SpecError(file, "job.micro_batch",
                            f"global_batch={job.global_batch} / (dp <= {widest_dp} x micro_batch={job.micro_batch}) "
                            f"is at least {fewest} micro-batches per step, more than the {MAX_MICROBATCHES} a "
                            f"schedule holds; raise micro_batch")


def check_fits(spec: Spec) -> None:
    """Refuse a model whose training state cannot fit on the whole cluster even fully sharded.

    Mixed-precision Adam keeps ~16 bytes per parameter (weights, grads, fp32 master and two
    moments); fp32 Adam also 16; SGD 8 (fp32) -- before any activation."""
    per_param = training_state_bytes_per_param(spec.job.precision, spec.job.optimizer)
    need = spec.model.param_count() * per_param
    have = spec.cluster.total_memory_bytes
    if need > have:
        raise SpecError(
            str(spec.path), "model",
            f"{spec.model.name} needs {_bytes(need)} of training state ({per_param} B/param, "
            f"{spec.job.precision} {spec.job.optimizer}) but the whole cluster has {_bytes(have)} "
            "of GPU memory: it cannot fit even fully sharded",
        )


def _bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _params(model: ModelSpec) -> str:
    n = model.param_count()
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def is_experiment(path: str | Path) -> bool:
    """Whether `path` is an experiment spec (it has a [job] table); False if it cannot be read."""
    try:
        return "job" in _read_toml(Path(path))
    except SpecError:
        return False


def validate_file(path: str | Path) -> str:
    """Validate any spec file; return a one-line summary. Raises SpecError."""
    path = Path(path)
    data = _read_toml(path)
    if "job" in data:
        s = load_spec(path)
        return (f"{path}: experiment {s.name!r}: {s.model.name} ({_params(s.model)} params) "
                f"on {s.cluster.name} ({len(s.cluster.datacenters)} DCs, {s.cluster.total_gpus} GPUs)")
    if "datacenters" in data:
        c = load_cluster(path)
        return (f"{path}: cluster {c.name!r}: {len(c.datacenters)} DCs, {c.total_gpus} GPUs, "
                f"{len(c.wan_links)} WAN link{'' if len(c.wan_links) == 1 else 's'}")
    if "layers" in data or "preset" in data:
        m = _model_from_dict(data, str(path), default_name=path.stem)
        return f"{path}: model {m.name!r}: {_params(m)} params"
    raise SpecError(str(path), "(top level)",
                    "not a cluster (datacenters), model (layers/preset) or experiment (job) spec")
