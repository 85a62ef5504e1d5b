"""The emulated WAN: a test instrument, never part of what a real cluster runs.

* `network.WanEmulation`: datacenters as network namespaces joined through a router namespace that
  adds each link's latency (`delayer`, a user-space TUN delayer), capacity and per-connection cap
  (`htb`, classes keyed on TCP source-port bits).
* `ports.spread_port_connections`: K connections bound to consecutive even source ports, so the
  htb buckets hold one connection each (how `StripedTransport` connects inside the emulation).
* `user_shaper`: user-space delay and rate limits handed to `StripedTransport` as its pacing hook (the
  fallback where namespaces are impossible); `fallback` chooses between the two.
* `probe`: ping/bulk-send probes run inside the namespaces.

Tests, `demo`, `validate-sim`, `profile` and `rehearse` use it; `geotrain.transport` (the striped
transport, temporal turns) imports nothing from here. Names are imported lazily, so light helpers
(the probes, the delayer) start without pydantic or torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "WanEmulation": "geotrain.emulation.network", "WanUnavailable": "geotrain.emulation.network",
    "emulation_available": "geotrain.emulation.network",
    "ShaperConfig": "geotrain.emulation.user_shaper", "shaper_for_link": "geotrain.emulation.user_shaper",
    "spread_port_connections": "geotrain.emulation.ports",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'geotrain.emulation' has no attribute {name!r}")
