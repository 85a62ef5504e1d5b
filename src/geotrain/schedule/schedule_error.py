"""The schedule package's error: a ValueError for callers that validate, and a GeotrainError so a
schedule request that came from the user's spec (an impossible micro-batch count for interleaving,
a deadlocking warm-up) reaches the CLI as one line and exit 2, not a traceback."""

from __future__ import annotations

from geotrain.errors import GeotrainError


class ScheduleError(GeotrainError, ValueError):
    """An impossible or inconsistent schedule (message names the stage, action and reason)."""
