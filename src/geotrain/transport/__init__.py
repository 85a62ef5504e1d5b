"""The WAN-aware transport a real cluster runs (Atlas mechanisms made real).

* `striped.StripedTransport`: one tensor striped over K authenticated TCP connections (`auth`,
  optional `tls`, listeners admitted by `admission`), resent across broken connections; hooks for
  how connections are opened and paced (the emulation plugs in there).
* `turns`: DP pipelines sharing a WAN link take turns (each alone at full rate) or share fairly.

The emulated WAN (namespaces, delayer, htb, user-space shaper) lives in `geotrain.emulation`.
Names are imported lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "StripedTransport": "geotrain.transport.striped", "TransportError": "geotrain.transport.striped",
    "TurnArbiter": "geotrain.transport.turns", "LocalTurns": "geotrain.transport.turns",
    "RemoteTurns": "geotrain.transport.turns", "FairSharing": "geotrain.transport.turns",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'geotrain.transport' has no attribute {name!r}")
