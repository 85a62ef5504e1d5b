"""Calibrate the simulator against the real runtime, and measure how well it predicts.

profile.py   -- the profile file: the cost model's profile format plus one extra key, "runtime".
measure.py   -- `measure_profile(spec)`, in order: timers.py (per-unit compute times measured the way
                the runtime runs them, the optimizer step, split backward, process start-up),
                overheads.py (per-action interpreter overhead on one real rank), pool.py (CPU
                contention between ranks, the DP all-reduce, p2p and the achieved WAN rate with n
                connections, on the runtime's launcher), calibration_run.py (a real 2-stage pipeline;
                for a dp = 1 job also at dp = 2, for the DP all-reduce's in-run factor).
calibrated_costs.py -- `CalibratedCosts`: the analytic StageCosts (layout.stage_costs) with what the
                profile measures in their place (calibrated_links.py: its p2p and WAN messages);
                `predict(spec, plan, profile)` simulates with them.
wanrun.py    -- `run_plan`: run a plan for real through the runtime's own launcher and WAN path
                (runtime.launch.run_with_wan, mode "shaper" or "kernel"), sampling the machine's load;
messages.py  -- per-message WAN transport overhead and the global all-reduce, read off a measured trace;
cpuload.py   -- how busy the (shared) machine was while we measured.
compare.py   -- predicted vs measured rows (iteration time, busy fraction, bubble time) and errors.
cases.py     -- the validation set; validate.py runs it and writes the markdown table.
"""

from geotrain.calibrate.measure import measure_profile
from geotrain.calibrate.profile_file import load_profile, save_profile

__all__ = ["load_profile", "measure_profile", "save_profile"]
