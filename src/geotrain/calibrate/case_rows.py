"""Predicted vs measured: one row per validation case, and the markdown table of all of them.

Both sides go through `geotrain.trace.metrics.compute_metrics`, so a prediction and a measurement
are judged by one yardstick. The measured trace loses its first `warmup` iterations (allocator,
autograd and gloo connection set-up make them slow; the simulator models steady state).

Errors are relative, (predicted - measured) / measured, except for the busy fraction, which is
already a fraction: its error is the mean over ranks of |predicted - measured| in percentage points.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from geotrain.trace.metrics import Metrics, compute_metrics
from geotrain.trace.schema import Trace


@dataclass
class CaseRow:
    case: str
    description: str
    predicted_iteration_s: float
    measured_iteration_s: float
    predicted_busy: dict[int, float]
    measured_busy: dict[int, float]
    predicted_bubble_s: float          # total bubble time per iteration, all ranks together
    measured_bubble_s: float
    predicted_bubble_rank: dict[int, float] = field(default_factory=dict)   # per rank, s per iteration
    measured_bubble_rank: dict[int, float] = field(default_factory=dict)
    posthoc_iteration_s: float | None = None   # predicted after the run, with its measured CPU share
    # replay (calibrate.replay): the run's own measured compute in the model of everything else
    replay_iteration_s: float | None = None
    replay_bubble_rank: dict[int, float] = field(default_factory=dict)

    @property
    def posthoc_error(self) -> float:
        return rel_error(self.posthoc_iteration_s, self.measured_iteration_s) \
            if self.posthoc_iteration_s is not None else float("nan")

    @property
    def replay_error(self) -> float:
        return rel_error(self.replay_iteration_s, self.measured_iteration_s) \
            if self.replay_iteration_s is not None else float("nan")

    @property
    def replay_bubble_error(self) -> float:
        """The ranks' mean bubble time, replayed against measured."""
        ranks = sorted(set(self.replay_bubble_rank) & set(self.measured_bubble_rank))
        if not ranks:
            return float("nan")
        return rel_error(sum(self.replay_bubble_rank[r] for r in ranks),
                         sum(self.measured_bubble_rank[r] for r in ranks))

    @property
    def replay_worst_rank_error(self) -> float:
        ranks = sorted(set(self.replay_bubble_rank) & set(self.measured_bubble_rank))
        errs = [abs(rel_error(self.replay_bubble_rank[r], self.measured_bubble_rank[r])) for r in ranks]
        return max(errs) if errs else float("nan")

    @property
    def iteration_error(self) -> float:
        return rel_error(self.predicted_iteration_s, self.measured_iteration_s)

    @property
    def bubble_error(self) -> float:
        return rel_error(self.predicted_bubble_s, self.measured_bubble_s)

    @property
    def worst_rank_bubble_error(self) -> float:
        """The largest |relative error| of one rank's bubble time."""
        ranks = sorted(set(self.predicted_bubble_rank) & set(self.measured_bubble_rank))
        errs = [abs(rel_error(self.predicted_bubble_rank[r], self.measured_bubble_rank[r])) for r in ranks]
        return max(errs) if errs else float("nan")

    @property
    def busy_error_pp(self) -> float:
        """Mean |predicted - measured| busy fraction over ranks, in percentage points."""
        ranks = sorted(set(self.predicted_busy) & set(self.measured_busy))
        if not ranks:
            return float("nan")
        return 100 * sum(abs(self.predicted_busy[r] - self.measured_busy[r]) for r in ranks) / len(ranks)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(iteration_error=self.iteration_error, bubble_error=self.bubble_error,
                 busy_error_pp=self.busy_error_pp, worst_rank_bubble_error=self.worst_rank_bubble_error,
                 posthoc_error=self.posthoc_error, replay_error=self.replay_error,
                 replay_bubble_error=self.replay_bubble_error)
        return d


def rel_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


def drop_warmup(trace: Trace, warmup: int) -> Trace:
    """The trace without its first `warmup` iterations (runtime iterations are numbered from 1)."""
    first = min((e.iteration for e in trace.events), default=0)
    keep = [e for e in trace.events if e.iteration >= first + warmup]
    if not keep:
        raise ValueError(f"the measured trace has no iterations left after dropping {warmup} warm-up iterations")
    return Trace(events=keep, num_ranks=trace.num_ranks, source=trace.source, meta=trace.meta)


def bubble_per_iteration(m: Metrics) -> float:
    return sum(b - a for _, a, b in m.bubbles) / max(1, m.iterations)


def bubble_per_rank(m: Metrics) -> dict[int, float]:
    """Seconds per iteration each rank spends without training compute."""
    out = {r: 0.0 for r in m.busy_fraction}
    for r, a, b in m.bubbles:
        out[r] = out.get(r, 0.0) + (b - a)
    return {r: v / max(1, m.iterations) for r, v in sorted(out.items())}


def compare_case(name: str, description: str, predicted: Metrics, measured: Metrics) -> CaseRow:
    return CaseRow(case=name, description=description,
                   predicted_iteration_s=predicted.iteration_time, measured_iteration_s=measured.iteration_time,
                   predicted_busy=dict(predicted.busy_fraction), measured_busy=dict(measured.busy_fraction),
                   predicted_bubble_s=bubble_per_iteration(predicted), measured_bubble_s=bubble_per_iteration(measured),
                   predicted_bubble_rank=bubble_per_rank(predicted), measured_bubble_rank=bubble_per_rank(measured))


def measured_metrics(trace: Trace, warmup: int, tokens: int) -> Metrics:
    return compute_metrics(drop_warmup(trace, warmup), tokens)


def summarize(rows: list[CaseRow]) -> dict[str, float]:
    errs = [abs(r.iteration_error) for r in rows]
    return {"cases": len(rows), "mean_abs_iteration_error": sum(errs) / len(errs) if errs else float("nan"),
            "worst_abs_iteration_error": max(errs) if errs else float("nan"),
            "mean_busy_error_pp": sum(r.busy_error_pp for r in rows) / len(rows) if rows else float("nan"),
            "mean_abs_bubble_error": sum(abs(r.bubble_error) for r in rows if r.bubble_error == r.bubble_error)
            / max(1, sum(1 for r in rows if r.bubble_error == r.bubble_error))}


def _busy(d: dict[int, float]) -> str:
    return " ".join(f"{100 * d[r]:.0f}" for r in sorted(d))


def markdown_table(rows: list[CaseRow]) -> str:
    head = ("| case | setup | iteration pred / meas (ms) | error | busy % per rank, pred | busy % per rank, meas "
            "| busy err (pp) | bubble pred / meas (ms) | bubble error |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        lines.append(f"| {r.case} | {r.description} | {1e3 * r.predicted_iteration_s:.1f} / "
                     f"{1e3 * r.measured_iteration_s:.1f} | {100 * r.iteration_error:+.1f}% "
                     f"| {_busy(r.predicted_busy)} | {_busy(r.measured_busy)} | {r.busy_error_pp:.1f} "
                     f"| {1e3 * r.predicted_bubble_s:.1f} / "
                     f"{1e3 * r.measured_bubble_s:.1f} | {100 * r.bubble_error:+.1f}% |")
    s = summarize(rows)
    foot = (f"\nMean |iteration-time error| {100 * s['mean_abs_iteration_error']:.1f}%, worst "
            f"{100 * s['worst_abs_iteration_error']:.1f}% over {s['cases']} cases; mean busy-fraction error "
            f"{s['mean_busy_error_pp']:.1f} pp; mean |bubble-time error| {100 * s['mean_abs_bubble_error']:.1f}%.\n")
    return head + "\n".join(lines) + "\n" + foot
