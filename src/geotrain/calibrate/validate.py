"""Run the validation set: profile (or load a profile), run + simulate every case, write the table.

Outputs in DIR: profile.json (when measured here), results.json (every row, the details of the
calibrated simulation and the run conditions), VALIDATION.md (the markdown table), and per case
DIR/<case>/ with its spec, the run directory and predicted_trace.jsonl.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def run_validation(out: Path, quick: bool = False, profile: dict | None = None, profile_spec=None,
                   steps: int = 6, warmup: int = 2, only: list[str] | None = None, say=print,
                   mode: str | None = None) -> tuple[list, str]:
    """Returns (rows, markdown). `profile_spec`: the Spec to profile when no profile is given
    (default: the tiny model of the first case). `mode`: the runtime WAN of every run (wanrun.py)."""
    from geotrain.calibrate.cases import CASES, QUICK, write_spec
    from geotrain.calibrate.compare import markdown_table, summarize
    from geotrain.calibrate.measure import measure_profile
    from geotrain.calibrate.profile import save_profile
    from geotrain.errors import GeotrainError

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = only or (QUICK if quick else [c.name for c in CASES])
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise GeotrainError(f"unknown validation case(s) {sorted(unknown)} (known: {', '.join(c.name for c in CASES)})")
    cases = [c for c in CASES if c.name in names]
    if profile is None:
        spec = profile_spec or write_spec(cases[0], out / "_profile_spec")
        say(f"profiling {spec.model.name} on this machine ...")
        t0 = time.time()
        profile = measure_profile(spec, quick=quick, mode=mode)
        save_profile(profile, out / "profile.json")
        say(f"  done in {time.time() - t0:.0f} s -> {out / 'profile.json'}")
    rows, details = [], {}
    for i, case in enumerate(cases, 1):
        from geotrain.calibrate.cases import run_case

        row, det = run_case(case, profile, out / case.name, steps=steps, warmup=warmup, mode=mode)
        rows.append(row)
        details[case.name] = det
        say(f"[{i}/{len(cases)}] {case.name:<14} predicted {1e3 * row.predicted_iteration_s:7.1f} ms  measured "
            f"{1e3 * row.measured_iteration_s:7.1f} ms  error {100 * row.iteration_error:+6.1f}%  "
            f"(other runnable threads {det['background_runnable']:.1f})")
    table = markdown_table(rows)
    modes = sorted({d["wan_mode"] for d in details.values()})
    conditions = (f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), one CPU thread "
                  f"per rank; WAN: {', '.join(modes)} (runtime.launch.run_with_wan); {steps} steps per case, the "
                  f"first {warmup} discarded. Background (mean number of "
                  "other threads ready to run on the machine while each case ran): "
                  + ", ".join(f"{n} {d['background_runnable']:.1f}" for n, d in details.items()) + ".\n")
    def errors(key: str) -> str:
        e = [abs(d[key] - r.measured_iteration_s) / r.measured_iteration_s for r, d in zip(rows, details.values())]
        return f"mean |iteration-time error| {100 * sum(e) / len(e):.1f}%, worst {100 * max(e):.1f}%"

    conditions += ("CPU sharing in the table: each stage's compute scaled by its ranks' measured slow-down "
                   "(run-queue wait / CPU time of the rank's main thread while it trained): "
                   + ", ".join(f"{n} " + "/".join(f"{v:.2f}" for _, v in sorted(d["rank_slowdown"].items()))
                               for n, d in details.items()) + ".\n")
    conditions += (f"Same runs, CPU sharing modelled instead (processor sharing, k ranks computing beside b other "
                   f"runnable threads sampled from /proc): {errors('predicted_iteration_s_modelled_sharing')}; "
                   f"b read as the CPU other work got: {errors('predicted_iteration_s_with_cores_used')}.\n")
    retried = [n for n, d in details.items() if d.get("retried_after")]
    if retried:
        conditions += f"Runs retried once after a failed first attempt: {', '.join(retried)}.\n"
    md = table + "\n" + conditions
    (out / "VALIDATION.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"summary": summarize(rows), "rows": [r.as_dict() for r in rows],
                                                  "details": details}, indent=1, default=float) + "\n")
    return rows, md
