"""The GPU validation's tables (markdown): per run, then the summary beside Sailor's simulator."""

from __future__ import annotations

from geotrain.calibrate.gpu_validation import SAILOR, GpuRunRow, GpuValidation


def _pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{100 * x:+.1f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def run_row(r: GpuRunRow) -> list[str]:
    overlapped = None if r.overlapped_s is None else (r.overlapped_s - r.measured_s) / r.measured_s
    note = "; ".join(([f"left out: {r.excluded}"] if r.excluded else []) + r.notes)
    return [r.run, r.layout, _s(r.measured_s), _s(r.predicted_s), _pct(r.error), _s(r.earlier_s),
            _pct(r.earlier_error), _pct(overlapped), f"{_s(r.measured_grad_s)} / {_s(r.predicted_grad_s)}",
            _gb(r.measured_mem), f"{_gb(r.predicted_alloc)} -> {_gb(r.predicted_mem)}", _pct(r.mem_error), note or ""]


HEAD = ["run", "layout", "iteration meas (s)", "pred (s)", "error", "earlier campaign (s)", "error vs earlier",
        "overlapped P2P: error", "grad reduction meas / pred (s)", "memory meas (GB)",
        "pred: allocated -> device (GB)", "memory error", "note"]


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


GOALS = (("iteration mean", "iteration_mean", 0.05), ("iteration worst", "iteration_worst", 0.10),
         ("memory mean", "memory_mean", 0.05))          # issue #26 item 1


def goal_line(v: GpuValidation) -> str:
    """The goal, whether each part is met, and the runs outside 10 % -- one line."""
    s = v.summary()
    met = [(name, s[key] <= limit) for name, key, limit in GOALS]
    verdict = "met" if all(ok for _, ok in met) else ", ".join(f"{n} {'met' if ok else 'NOT met'}" for n, ok in met)
    over = [f"{r.run} {100 * r.error:+.1f} %" for r in v.included() if abs(r.error) > 0.10]
    return ("Goal: iteration mean <= 5 %, worst <= 10 %, memory mean <= 5 %: " + verdict + "."
            + (f" Outside 10 %: {', '.join(over)}." if over else ""))


def gpu_markdown(v: GpuValidation) -> str:
    s = v.summary()
    runs = _table(HEAD, [run_row(r) for r in v.rows])
    pct = lambda x: f"{100 * x:.1f} %"   # noqa: E731
    summary = _table(["", "iteration mean", "iteration worst", "memory mean", "memory worst"], [
        ["geotrain, blocking P2P (the runs' runtime), latest campaign", pct(s["iteration_mean"]),
         pct(s["iteration_worst"]), pct(s["memory_mean"]), pct(s["memory_worst"])],
        ["geotrain, same predictions vs the earlier campaign", pct(s["earlier_iteration_mean"]),
         pct(s["earlier_iteration_worst"]), pct(s["earlier_memory_mean"]), "-"],
        ["geotrain, memory leave-one-out (fit without the run)", "-", "-", pct(s["memory_loo_mean"]),
         pct(s["memory_loo_worst"])],
        ["geotrain with overlapped P2P (its own runtime's; ablation)", pct(s["overlapped_iteration_mean"]),
         pct(s["overlapped_iteration_worst"]), "-", "-"],
        ["Sailor's simulator (SOSP'25, Fig. 5, same runs)", pct(SAILOR["iteration_mean"]),
         pct(SAILOR["iteration_worst"]), pct(SAILOR["memory_mean"]), "-"],
    ])
    fit = (f"Device memory = {s['memory_base_bytes'] / 1e9:.2f} GB + (1 + {s['memory_reserve']:.3f}) x the "
           f"simulator's peak of allocated bytes per GPU (the two fitted numbers; least squares over the "
           f"{s['runs']} runs' latest memory).")
    return f"{goal_line(v)}\n\n{summary}\n\n{fit}\n\n{runs}\n"
