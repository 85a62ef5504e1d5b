"""Run the validation set: profile once, then for every run, WAN mode and case predict first and
measure after, and write the tables.

Order, and why: the profile (`geotrain profile`'s measure_profile, its calibration run over the
first mode's WAN; the other modes get their own calibration run, `measure.recalibrate`) is taken
once at the start and saved as DIR/profile-<mode>.json; each case's prediction is made from that
file alone and written before its run starts (cases.run_case), so nothing measured in a run
feeds its own prediction. `runs` repeats the whole set (every mode, every case) with the same
profiles, so the runs differ only by what the machine did meanwhile.

Outputs in DIR: profile-<mode>.json, results.json (every row, every run, the details),
VALIDATION.md (the tables), and per run, mode and case DIR/run<k>/<mode>/<case>/ with its spec,
the run directory (measured trace, Chrome trace) and predicted_trace.jsonl.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from geotrain.calibrate.calibrated_costs import profile_mode
from geotrain.calibrate.case_rows import summarize
from geotrain.calibrate.cases import CASES, QUICK, run_case, write_spec
from geotrain.calibrate.measure import measure_profile, recalibrate
from geotrain.calibrate.profile_file import save_profile
from geotrain.calibrate.tables import validation_markdown
from geotrain.errors import GeotrainError

MODES = ("kernel", "shaper")


def select_cases(quick: bool, only: list[str] | None):
    names = only or (QUICK if quick else [c.name for c in CASES])
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise GeotrainError(f"unknown validation case(s) {sorted(unknown)} (known: {', '.join(c.name for c in CASES)})")
    return [c for c in CASES if c.name in names]


def profiles_for(modes, out: Path, spec, quick: bool, profile: dict | None, say=print) -> dict[str, dict]:
    """One profile per WAN mode: `profile` (or a fresh measure_profile over the first mode) and, for
    each other mode, the same profile recalibrated over it. Saved as out/profile-<mode>.json."""
    t0 = time.time()
    if profile is None:
        say(f"profiling {spec.model.name} on this machine ({modes[0]} WAN) ...")
        profile = measure_profile(spec, quick=quick, mode=modes[0])
    out_profiles = {}
    for m in modes:
        if profile_mode(profile) == m:
            out_profiles[m] = profile
        else:
            say(f"calibration run over the {m} WAN ...")
            out_profiles[m] = recalibrate(spec, profile, m)
        save_profile(out_profiles[m], out / f"profile-{m}.json")
    say(f"  profiles done in {time.time() - t0:.0f} s -> {out}/profile-<mode>.json")
    return out_profiles


def run_validation(out: Path, quick: bool = False, profile: dict | None = None, profile_spec=None,
                   steps: int = 6, warmup: int = 2, only: list[str] | None = None, say=print,
                   modes=MODES, runs: int = 1, other_mode_runs: int = 1) -> tuple[dict, str]:
    """Returns (results, markdown). `profile_spec`: the Spec to profile when no profile is given
    (default: the tiny model of the first case). `modes`: the runtime WAN of each column, the first
    one the headline, measured in every run; the others in the first `other_mode_runs` runs only
    (each mode's pass over the set costs as much as the headline's: the default keeps
    `--runs 3` with two modes at four passes)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    modes = tuple(modes)
    if not modes or set(modes) - {"kernel", "shaper", "auto"}:
        raise GeotrainError(f"--wan modes must be among kernel, shaper, auto (got {', '.join(modes) or 'none'})")
    cases = select_cases(quick, only)
    t_start = time.time()
    spec = profile_spec or write_spec(cases[0], out / "_profile_spec")
    profiles = profiles_for(modes, out, spec, quick, profile, say)
    all_runs = []
    for k in range(1, runs + 1):
        per_mode = {}
        for m in modes if k <= other_mode_runs else modes[:1]:
            rows, details = [], {}
            for i, case in enumerate(cases, 1):
                row, det = run_case(case, profiles[m], out / f"run{k}" / m / case.name, steps=steps,
                                    warmup=warmup, mode=m)
                rows.append(row)
                details[case.name] = det
                say(f"[run {k}/{runs} {m} {i}/{len(cases)}] {case.name:<14} predicted "
                    f"{1e3 * row.predicted_iteration_s:7.1f} ms  measured {1e3 * row.measured_iteration_s:7.1f} ms "
                    f"error {100 * row.iteration_error:+6.1f}%  bubble {100 * row.bubble_error:+6.1f}%  "
                    f"(other runnable threads {det['background_runnable']:.1f}"
                    + (f", sessions {det['background_sessions']:.1f}" if det.get("background_sessions") is not None
                       else "") + ")")
            per_mode[m] = {"rows": rows, "details": details}
        all_runs.append(per_mode)
    wall = time.time() - t_start
    conditions = {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(), "steps": steps,
                  "warmup": warmup, "runs": runs, "modes": list(modes), "other_mode_runs": other_mode_runs,
                  "wall_s": wall}
    md = validation_markdown(all_runs, modes, conditions)
    (out / "VALIDATION.md").write_text(md)
    results = {"conditions": conditions,
               "runs": [{m: {"summary": summarize(r[m]["rows"]), "rows": [x.as_dict() for x in r[m]["rows"]],
                             "details": r[m]["details"]} for m in r} for r in all_runs]}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float) + "\n")
    return results, md
