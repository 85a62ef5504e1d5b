"""The real training runtime: executes a plan's per-stage action lists with torch.distributed.

launch.py (one process per rank) -> worker.py (process group) -> trainer.py (build stages from
the plan, parallelize.py wraps them) -> pipeline.py (the action interpreter, moving tensors through
transport.py) with scaler.py (global fp16 overflow decision), checkpoint.py (atomic DCP) and
recorder.py / summary.py (measured trace in the simulator's schema).
"""

from geotrain.runtime.p2p import TorchTransport, Transport, Work

__all__ = ["TorchTransport", "Transport", "Work"]
