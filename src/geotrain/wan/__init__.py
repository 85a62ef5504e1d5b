"""WAN emulation and WAN-aware transport (Atlas mechanisms made real).

* `emulation.WanEmulation`: datacenters as network namespaces joined through a router namespace
  that adds each link's latency (user-space TUN delayer), capacity and per-connection cap (htb).
* `striped.StripedTransport`: one tensor striped over K TCP connections, reassembled and verified;
  with an optional user-space `shaper.ShaperConfig` (the fallback where namespaces are not possible).
* `temporal`: DP pipelines sharing a WAN link take turns (one at a time at full rate) or share fairly.

Names are imported lazily, so light helpers (the probes, the delayer) start without pydantic or torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "WanEmulation": "geotrain.wan.emulation", "WanUnavailable": "geotrain.wan.emulation",
    "emulation_available": "geotrain.wan.emulation",
    "StripedTransport": "geotrain.wan.striped", "TransportError": "geotrain.wan.striped",
    "ShaperConfig": "geotrain.wan.shaper", "shaper_for_link": "geotrain.wan.shaper",
    "TurnArbiter": "geotrain.wan.temporal", "LocalTurns": "geotrain.wan.temporal",
    "RemoteTurns": "geotrain.wan.temporal", "FairSharing": "geotrain.wan.temporal",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'geotrain.wan' has no attribute {name!r}")
