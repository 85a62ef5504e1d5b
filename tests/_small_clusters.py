"""Small clusters written as spec files, for planner tests (pins, exhaustive optimum, sharing).

Each helper writes cluster.toml + spec.toml into a directory and returns the loaded Spec; the
clusters are tiny enough that the exhaustive checker (geotrain.planner.exhaustive) can enumerate
every layout in well under a second.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path


def write_spec(directory: Path, dcs: list[tuple[str, str, int]], links: list[tuple[str, str, float, float, float]],
               model: str, job: dict, name: str = "small", region: str | None = None):
    """dcs: (name, gpu type, gpus[, gpus per node, default 8]); links: (a, b, latency ms, capacity
    Gbit/s, per-connection Gbit/s); region: one region holding every DC (DP may then span them)."""
    from geotrain.spec import load_spec

    directory.mkdir(parents=True, exist_ok=True)
    text = f'name = "{name}"\n'
    for n, t, g, *node in dcs:
        text += (f'\n[[datacenters]]\nname = "{n}"\ngpu_type = "{t}"\ngpus = {g}\ngpus_per_node = {(node or [8])[0]}\n'
                 f'intra_node_gbps = 2400\nintra_dc_gbps = 200\nintra_dc_latency_us = 4\n'
                 + (f'region = "{region}"\n' if region else ''))
    for a, b, lat, cap, per in links:
        text += (f'\n[[wan_links]]\nbetween = ["{a}", "{b}"]\nlatency_ms = {lat}\ncapacity_gbps = {cap}\n'
                 f'per_connection_gbps = {per}\nmax_connections = 64\n')
    (directory / "cluster.toml").write_text(text)
    jobtext = "\n".join(f"{k} = {v!r}".replace("'", '"') for k, v in job.items())
    (directory / "spec.toml").write_text(f'name = "{name}"\ncluster = "cluster.toml"\nmodel = "{model}"\n\n'
                                         f'[job]\n{jobtext}\n')
    return load_spec(directory / "spec.toml")


def mesh(names: list[str], lat: float = 20, cap: float = 10, per: float = 2) -> list:
    return [(a, b, lat, cap, per) for a, b in combinations(names, 2)]


def abc_64_32_16(directory: Path, **job):
    """The issue's example: A100 DCs of 64, 32 and 16 GPUs in a full mesh, Llama-2-7B."""
    base = {"global_batch": 64, "micro_batch": 1, "precision": "bf16"}
    return write_spec(directory, [("A", "a100-80g", 64), ("B", "a100-80g", 32), ("C", "a100-80g", 16)],
                      mesh(["A", "B", "C"]), "llama2-7b", {**base, **job}, name="abc")
