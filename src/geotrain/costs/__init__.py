"""Cost model: FLOPs, bytes and time of each model unit, and memory per GPU of a stage.

`CostModel` is the one entry point (see model.py); the formulas live in units.py (per-unit FLOPs
and saved bytes), memory.py (training state), comm.py (collectives) and profile.py (measured
per-unit times that replace the FLOP estimate).
"""

from geotrain.costs.cost_model import CostModel, MemoryBreakdown, StageTimes

__all__ = ["CostModel", "MemoryBreakdown", "StageTimes"]
