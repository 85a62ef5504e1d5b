"""A validated spec as one JSON-able document, and back: how a plan file carries its experiment.

A plan file that names its spec by path stops working when it is moved (or the spec is edited
after planning). `spec_document` writes the *resolved* spec -- cluster, model and job as
validated, paths made absolute -- and `spec_from_document` validates it again exactly like a
TOML spec (one-line `SpecError`s naming the file and field, the same shape and fit checks).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from geotrain.errors import SpecError, printable
from geotrain.spec.cluster import Cluster
from geotrain.spec.job import JobSpec
from geotrain.spec.load import Spec, _validate, check_fits, check_shape
from geotrain.spec.model import ModelSpec

DOCUMENT_KEYS = {"name", "cluster", "model", "job", "bubbletea", "source"}


def spec_document(spec: Spec) -> dict[str, Any]:
    """The spec as plain data; `job.data` (a path relative to the spec) made absolute."""
    job = spec.job.model_dump()
    if spec.job.data_sources and spec.path is not None:
        def absolute(data: str) -> str:
            if data == "stdlib":
                return data
            p = Path(data).expanduser()
            near = spec.path.parent / p
            return str((near if near.exists() else p).resolve())

        if isinstance(job["data"], str):
            job["data"] = absolute(job["data"])
        else:
            job["data"] = [{**src, "path": absolute(src["path"])} for src in job["data"]]
    return {"name": spec.name, "source": str(spec.path.resolve()) if spec.path else None,
            "cluster": spec.cluster.model_dump(mode="json"), "model": spec.model.model_dump(mode="json"),
            "job": job, "bubbletea": spec.bubbletea}


def spec_from_document(doc: Any, where: str, prefix: str = "resolved_spec") -> Spec:
    """A Spec from `spec_document`'s output, validated; `where` names the file for errors."""
    if not isinstance(doc, dict):
        raise SpecError(where, prefix, "must be a table")
    unknown = sorted(set(doc) - DOCUMENT_KEYS)
    if unknown:
        raise SpecError(where, f"{prefix}.{unknown[0]}", "unknown key")
    for key in ("name", "cluster", "model", "job"):
        if key not in doc:
            raise SpecError(where, f"{prefix}.{key}", "required field is missing")
    name = doc["name"]
    if not isinstance(name, str) or not name or "/" in name or printable(name) != name:
        raise SpecError(where, f"{prefix}.name", "must be a non-empty string without '/' or control characters")
    cluster = _validate(Cluster, doc["cluster"], where, f"{prefix}.cluster")
    model = _validate(ModelSpec, doc["model"], where, f"{prefix}.model")
    job = _validate(JobSpec, doc["job"], where, f"{prefix}.job")
    bt = doc.get("bubbletea")
    if bt is not None and not isinstance(bt, dict):
        raise SpecError(where, f"{prefix}.bubbletea", "must be a table")
    spec = Spec(name=name, cluster=cluster, model=model, job=job, path=Path(where), bubbletea=bt)
    check_shape(spec)
    check_fits(spec)
    source = doc.get("source")
    # The spec keeps naming the TOML it was resolved from (it need not exist here: nothing reads it).
    return replace(spec, path=Path(source)) if isinstance(source, str) and source else spec
