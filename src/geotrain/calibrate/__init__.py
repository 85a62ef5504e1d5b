"""Calibrate the simulator against the real runtime, and measure how well it predicts.

`geotrain profile` measures (`measure.measure_profile`: timers, overheads, pool, calibration_run,
messages, cpuload) into the profile file (`profile_file`); `calibrated_costs.CalibratedCosts` (with
`calibrated_links`, `waits`) turns it into the simulator's inputs, and `predict` writes a
prediction beside a run. Validation runs plans for real (`wanrun`) and compares: the CPU set
(`cases`, `validation`, `case_rows`, `tables`), trace replay (`replay`), ranking (`ranking`),
link sharing (`link_sharing`) and published GPU runs (`gpu_runs`, `gpu_validation`). The package
imports none of them: `geotrain train` needs `predict` and `profile_file`, not torch (`measure`).
"""
