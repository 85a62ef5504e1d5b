"""The real training runtime: executes a plan's per-stage action lists with torch.distributed.

launch.py (one process per rank) -> worker.py (process group) -> rank_run.py (the rank's run:
rank_model.py builds its chunks, parallelize.py wraps them) -> trainer.py (the step) ->
interpreter.py (the action list, moving tensors through p2p.py / cross_dc.py), with scaler.py
(global fp16 overflow decision), checkpoint.py (atomic DCP) and recorder.py / outputs.py
(measured trace in the simulator's schema). whole_model.py runs a whole model in one process.
The launcher's side (launch.py, cross_dc.py's open_wan, runfile.py, host_devices.py) imports no
torch: `geotrain train` starts its ranks without loading it.
"""
