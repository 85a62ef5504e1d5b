"""The trace schema shared by simulator and runtime, its files, and metrics computed from it."""

from geotrain.trace.schema import Event, Trace

__all__ = ["Event", "Trace"]
