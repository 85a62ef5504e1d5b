"""Comparisons a report shows: a predicted trace against a measured one, and the rows of one
plan under every schedule kind.

The report draws what it is given: the schedule rows come from simulations that
`geotrain.orchestrate.schedule_kinds.compare_schedules` runs (the simulator sits below the report's
callers, not below the report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from geotrain.console import human_bytes, human_rate, human_seconds
from geotrain.trace.metrics import WAN_COLLECTIVE_BYTES, Metrics, compute_metrics, compute_ratio
from geotrain.trace.rank_roles import num_ranks
from geotrain.trace.schema import Trace


class CompareRow(NamedTuple):
    """One line of a predicted-vs-measured table. rel_error = (predicted - measured) / measured
    (nan when the measured value is 0)."""

    metric: str
    predicted: float
    measured: float
    rel_error: float
    unit: str
    note: str = ""          # why a prediction outside TOLERANCE cannot agree (see explain_rows)


TOLERANCE = 0.10
WARMUP_ITERATIONS = 2      # measured iterations left out of a comparison (see steady_state)


def steady_state(measured: Trace, warmup: int = WARMUP_ITERATIONS) -> Trace:
    """The measured trace without its first `warmup` iterations, when at least two are left: the
    simulator predicts steady state, and a run's first iterations also pay connection set-up,
    allocator growth and autograd's first graph (the demo's 30 steps: 350 ms per iteration over
    all of them, 287 ms over iterations 3-30, against 281 ms predicted). The same cut as the
    validation set's (calibrate.case_rows.drop_warmup)."""
    its = sorted({e.iteration for e in measured.events})
    if len(its) < warmup + 2:
        return measured
    keep = [e for e in measured.events if e.iteration >= its[warmup]]
    return Trace(events=keep, num_ranks=measured.num_ranks, source=measured.source, meta=measured.meta)


def explain_rows(rows: list[CompareRow], predicted: Trace, measured: Trace) -> list[CompareRow]:
    """Every row whose prediction is more than TOLERANCE off says why, or that nothing known does:
    a user must not be left with an unexplained error.

    Known causes, read off the traces: an uncalibrated prediction (datasheet speeds, not this
    machine's); other work on the machine while the run trained, beyond what the profile saw
    (`_other_load`); compute that ran at another speed than the profile measured
    (trace.metrics.compute_ratio off by more than TOLERANCE); ranks that shared CPU cores (a
    measured event's wall time includes waiting for a core, and the collectives' and transport's
    threads wait for cores too, which the calibrated simulator does not share out; measurements
    in docs/DECISIONS.md, Calibration). WAN bytes depend on
    neither, so a WAN-bytes error is never put down to them -- but a CPU run's collectives ran on
    gloo, which sends more than the NCCL count the prediction carries (layout/wan_bytes.py)."""
    pmeta = predicted.meta if isinstance(predicted.meta, dict) else {}
    mmeta = measured.meta if isinstance(measured.meta, dict) else {}
    ranks, cores = measured.num_ranks, int(mmeta.get("cores") or 0)
    shared = mmeta.get("device") == "cpu" and 0 < cores < ranks
    busy = _other_load(pmeta, mmeta)
    speed = compute_ratio(predicted, steady_state(measured))
    out = []
    for r in rows:
        if r.rel_error != r.rel_error or abs(r.rel_error) <= TOLERANCE:
            out.append(r)
            continue
        note = "outside 10%: no known cause"
        if r.unit != "B" and not pmeta.get("calibrated"):
            note = "uncalibrated prediction (datasheet speeds, not this machine's): train with --profile"
        elif r.unit != "B" and busy:
            during, before = busy
            note = (f"this machine ran other work during the run: {during:.1f} other runnable threads on average, "
                    f"{before:.1f} when the profile was taken (RUN_DIR/machine_load.json); a prediction made "
                    "before the run cannot know that load")
        elif r.unit != "B" and speed is not None and abs(speed - 1.0) > TOLERANCE:
            note = (f"training compute took {speed:.2f}x the predicted time (forward, backward and optimizer per "
                    f"iteration, all ranks): this run computed {'slower' if speed > 1 else 'faster'} than the profile "
                    "measured, so the error is compute speed, not the network or the schedule")
            if shared:
                note += f", and {ranks} ranks shared {cores} CPU cores (sim.cores)"
        elif r.unit != "B" and shared:
            note = (f"{ranks} ranks shared {cores} CPU cores: the simulator shares the cores between the ranks "
                    "computing at once (sim.cores); in the run the gloo collectives' and transport threads wait "
                    "for cores too, and that waiting is measured as idle, so busy vs idle time splits differently")
        elif r.unit == "B" and mmeta.get("device") == "cpu" and pmeta.get(WAN_COLLECTIVE_BYTES):
            note = ("CPU run: its collectives ran on gloo, whose reduce-scatter is an all-reduce on the wire; the "
                    "prediction counts NCCL's (layout.wan_bytes, backend)")
        out.append(r._replace(note=note))
    return out


OTHER_LOAD_THREADS = 0.5   # other runnable threads beyond the profile's that make a run "loaded"


def _other_load(pmeta: dict, mmeta: dict) -> tuple[float, float] | None:
    """(other runnable threads during the run, during the profile's calibration run) when the run
    met at least OTHER_LOAD_THREADS more than the calibrated prediction assumed, else None. The
    run's number is `geotrain train`'s sampler (measured.meta["machine_load"], from
    RUN_DIR/machine_load.json); the prediction's is what `calibrate.calibrated_costs.predict` assumed."""
    load, cal = mmeta.get("machine_load"), pmeta.get("calibrated")
    if not isinstance(load, dict) or not isinstance(cal, dict):
        return None
    try:
        during, before = float(load["background_runnable"]), float(cal.get("background_runnable") or 0.0)
    except (KeyError, TypeError, ValueError):
        return None
    return (during, before) if during - before >= OTHER_LOAD_THREADS else None


def format_value(v: float, unit: str) -> str:
    """A CompareRow value in human units ("s", "B", "fraction" or a rate unit such as "tok/s")."""
    if v != v:  # nan: the trace does not record this quantity
        return "not recorded"
    if unit == "s":
        return human_seconds(v)
    if unit == "B":
        return human_bytes(v)
    if unit == "fraction":
        return f"{100 * v:.1f}%"
    return human_rate(v, unit)


def format_rel(x: float) -> str:
    return "-" if x != x else f"{100 * x:+.1f}%"


def _rel(p: float, m: float) -> float:
    return (p - m) / m if m else float("nan")


def tokens_of(trace: Trace) -> int:
    """Tokens per iteration as recorded in the trace's meta (0 if it does not say)."""
    v = trace.meta.get("tokens_per_iteration", 0) if isinstance(trace.meta, dict) else 0
    return int(v or 0)


def compare_metrics(pm: Metrics, mm: Metrics, num_ranks: tuple[int, int]) -> list[CompareRow]:
    rows = [CompareRow("iteration time", pm.iteration_time, mm.iteration_time,
                       _rel(pm.iteration_time, mm.iteration_time), "s")]
    if pm.tokens_per_s > 0 and mm.tokens_per_s > 0 and pm.tokens_per_s != float("inf"):
        rows.append(CompareRow("tokens/s", pm.tokens_per_s, mm.tokens_per_s,
                               _rel(pm.tokens_per_s, mm.tokens_per_s), "tok/s"))
    rows.append(CompareRow("mean utilization", pm.mean_utilization, mm.mean_utilization,
                           _rel(pm.mean_utilization, mm.mean_utilization), "fraction"))

    def bubble_per_gpu(m: Metrics, n: int) -> float:
        return sum(b - a for _, a, b in m.bubbles) / max(1, n) / max(1, m.iterations)

    pb, mb = bubble_per_gpu(pm, num_ranks[0]), bubble_per_gpu(mm, num_ranks[1])
    rows.append(CompareRow("bubble time per GPU per iteration", pb, mb, _rel(pb, mb), "s"))
    rows.append(CompareRow("bubble fraction", pm.bubble_fraction, mm.bubble_fraction,
                           _rel(pm.bubble_fraction, mm.bubble_fraction), "fraction"))
    if pm.wan_bytes or mm.wan_bytes:
        # The runtime records no transfer events, so a measured 0 next to a predicted >0 means
        # "not recorded", not "nothing crossed the WAN" (a plan with WAN transfers always sends).
        measured = mm.wan_bytes if mm.wan_bytes or not pm.wan_bytes else float("nan")
        rows.append(CompareRow("WAN bytes per iteration", pm.wan_bytes, measured,
                               _rel(pm.wan_bytes, measured), "B"))
    return rows


def compare_traces(predicted: Trace, measured: Trace, tokens_per_iteration: int | None = None) -> list[CompareRow]:
    """Iteration time, tokens/s (when tokens are known), utilization, bubble time and WAN bytes
    of both traces and their relative error; both traces go through the same `compute_metrics`."""
    tok = tokens_per_iteration if tokens_per_iteration is not None else (tokens_of(predicted) or tokens_of(measured))
    pm = compute_metrics(predicted, tok)
    mm = compute_metrics(measured, tok)
    return compare_metrics(pm, mm, (num_ranks(predicted), num_ranks(measured)))


# -- schedule kinds -------------------------------------------------------------------------

@dataclass
class ScheduleRow:
    kind: str
    iteration_time: float | None
    tokens_per_s: float | None
    mean_utilization: float | None
    bubble_fraction: float | None
    peak_memory: float | None
    note: str

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def row_from_metrics(kind: str, m: Metrics, note: str = "") -> ScheduleRow:
    return ScheduleRow(kind, m.iteration_time, m.tokens_per_s, m.mean_utilization, m.bubble_fraction,
                       max(m.peak_memory.values()) if m.peak_memory else None, note)
