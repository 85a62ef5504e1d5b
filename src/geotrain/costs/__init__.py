"""Cost model: FLOPs, bytes and time of each model unit, and memory per GPU of a stage.

`CostModel` (cost_model.py) is the one entry point; the formulas live in units.py (per-unit
parameters and FLOPs), activations.py (saved bytes), memory.py (training state), comm.py
(collectives), experts.py (mixture of experts), compression.py (compressed bytes) and
unit_times.py (measured per-unit times that replace the FLOP estimate).
"""

from geotrain.costs.cost_model import CostModel, MemoryBreakdown, StageTimes

__all__ = ["CostModel", "MemoryBreakdown", "StageTimes"]
