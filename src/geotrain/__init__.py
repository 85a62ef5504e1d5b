"""geotrain: plan, simulate and run LLM training across datacenters joined by a slow WAN.

Data flows one way: spec (TOML) -> plan -> schedule -> {simulator | runtime} -> trace -> report.
See docs/ARCHITECTURE.md. The Python API (docs/API.md), loaded on first use so that
`import geotrain` and `geotrain --help` stay light:

    spec = geotrain.load_spec("examples/tiny_2dc.toml")
    chosen = geotrain.plan(spec).plan                 # the planner's choice (a Plan)
    geotrain.simulate(spec, chosen).metrics           # predicted iteration time, bubbles, memory
    geotrain.train(spec, chosen, steps=3).losses      # real training, one process per rank
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = ("load_spec", "plan", "simulate", "train", "TrainConfig", "TrainResult")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    """PEP 562: the API's names, imported from `geotrain.orchestrate.api` when first asked for."""
    if name in _API:
        return getattr(importlib.import_module("geotrain.orchestrate.api"), name)
    raise AttributeError(f"module 'geotrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
