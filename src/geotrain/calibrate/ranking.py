"""Ranking: does the simulator order pairs of plans the way they really run?

A planner needs the order of its candidates more than their absolute times. Each pair below is a
choice the planner makes (schedule kind, connections per link, fair vs temporal sharing, the pp/dp
split of the same GPUs and global batch, checkpointing), two validation cases on the same two-DC
kernel-emulated WAN. Both arms are predicted from one profile before anything runs; then the arms
run INTERLEAVED -- A B A B ..., `rounds` times each, every pair's arms next to each other -- so a
machine whose speed drifts over minutes (this one: 0.7-1.3x) slows both arms alike. The measured
ratio is the ratio of the arms' medians over rounds; it is set beside the predicted ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from geotrain.calibrate.calibrated_costs import predict
from geotrain.calibrate.case_rows import measured_metrics
from geotrain.calibrate.cases import Case, case_plan, write_spec
from geotrain.calibrate.wanrun import run_plan
from geotrain.trace.schema import Trace


@dataclass(frozen=True)
class Pair:
    name: str
    a: Case
    b: Case


PAIRS: list[Pair] = [
    Pair("schedule: gpipe vs 1f1b", Case("gpipe", schedule="gpipe", latency_ms=20, per_connection_mbps=20),
         Case("1f1b", latency_ms=20, per_connection_mbps=20)),
    Pair("schedule: zb-h1 vs 1f1b", Case("zb-h1", schedule="zb-h1", latency_ms=10, per_connection_mbps=50),
         Case("1f1b-50", latency_ms=10, per_connection_mbps=50)),
    Pair("connections: 1 vs 4", Case("narrow-1", latency_ms=10, per_connection_mbps=5),
         Case("narrow-4", latency_ms=10, per_connection_mbps=5, connections=4)),
    Pair("sharing: fair vs temporal", Case("dp2-fair", dp=2, latency_ms=10, per_connection_mbps=10, capacity_mbps=10),
         Case("dp2-temporal", dp=2, latency_ms=10, per_connection_mbps=10, capacity_mbps=10, sharing="temporal")),
    Pair("split: pp2 x dp2 vs pp4 x dp1", Case("pp2xdp2", dp=2, latency_ms=10, per_connection_mbps=20),
         Case("pp4xdp1", pp=4, num_microbatches=8, latency_ms=10, per_connection_mbps=20)),
    Pair("checkpointing: full vs none", Case("full", latency_ms=10, per_connection_mbps=50, checkpointing="full"),
         Case("none", latency_ms=10, per_connection_mbps=50)),
]


def run_order(pairs: list[Pair], rounds: int) -> list[tuple[int, str, int]]:
    """(pair index, "a" | "b", round) in the order the arms run: per round every pair's A then its
    B -- A B A B -- so no arm ever runs twice in a row and each pair's arms sit side by side."""
    return [(i, arm, r) for r in range(rounds) for i in range(len(pairs)) for arm in ("a", "b")]


@dataclass
class PairResult:
    name: str
    a: str
    b: str
    predicted_a: float
    predicted_b: float
    measured_a: list[float] = field(default_factory=list)   # per round, seconds per iteration
    measured_b: list[float] = field(default_factory=list)

    @property
    def predicted_ratio(self) -> float:
        return self.predicted_a / self.predicted_b

    @property
    def measured_ratio(self) -> float:
        return statistics.median(self.measured_a) / statistics.median(self.measured_b)

    @property
    def ratio_error(self) -> float:
        return self.predicted_ratio / self.measured_ratio - 1

    @property
    def ordered_right(self) -> bool:
        return (self.predicted_ratio > 1) == (self.measured_ratio > 1)

    @property
    def predicted_gap(self) -> float:
        return abs(self.predicted_ratio - 1)


Runner = Callable[[Case, Path], float]   # runs a case for real into a directory, returns s per iteration
Predictor = Callable[[Case, Path], float]


def run_ranking(pairs: list[Pair], rounds: int, out: Path, predictor: Predictor, runner: Runner,
                say=print) -> list[PairResult]:
    """Predict every arm, then run them in `run_order`; returns one PairResult per pair."""
    out = Path(out)
    results = [PairResult(p.name, p.a.name, p.b.name, predictor(p.a, out / f"p{i}" / "a"),
                          predictor(p.b, out / f"p{i}" / "b")) for i, p in enumerate(pairs)]
    for n, (i, arm, r) in enumerate(run_order(pairs, rounds), 1):
        case = getattr(pairs[i], arm)
        t = runner(case, out / f"p{i}" / arm / f"round{r}")
        getattr(results[i], f"measured_{arm}").append(t)
        say(f"[{n}/{2 * rounds * len(pairs)}] {pairs[i].name}: {case.name} round {r + 1} "
            f"{1e3 * t:.1f} ms per iteration")
    return results


def case_predictor(profile: dict, steps: int, warmup: int, mode: str) -> Predictor:
    def run(case: Case, directory: Path) -> float:
        spec = write_spec(case, directory)
        sim, _ = predict(spec, case_plan(spec, case), profile, iterations=steps - warmup, mode=mode)
        return sim.metrics.iteration_time
    return run


def case_runner(steps: int, warmup: int, mode: str) -> Runner:
    def run(case: Case, directory: Path) -> float:
        spec = write_spec(case, directory)
        plan = case_plan(spec, case)
        trace_path, _ = run_plan(spec, plan, directory / "run", steps=steps, mode=mode, warmup=warmup)
        return measured_metrics(Trace.read_jsonl(trace_path), warmup, plan.global_batch * spec.model.seq_len) \
            .iteration_time
    return run


def ranking_markdown(results: list[PairResult], rounds: int, wall_s: float) -> str:
    head = ["pair", "A / B", "predicted A / B (ms)", "predicted ratio", "measured A (ms), per round",
            "measured B (ms), per round", "measured ratio (medians)", "ratio error", "ordered right"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r.name} | {r.a} / {r.b} | {1e3 * r.predicted_a:.1f} / {1e3 * r.predicted_b:.1f} "
                     f"| {r.predicted_ratio:.3f} | {' '.join(f'{1e3 * x:.0f}' for x in r.measured_a)} "
                     f"| {' '.join(f'{1e3 * x:.0f}' for x in r.measured_b)} | {r.measured_ratio:.3f} "
                     f"| {100 * r.ratio_error:+.1f}% | {'yes' if r.ordered_right else 'NO'}"
                     + ("" if r.predicted_gap > 0.10 else " (gap <= 10 %)") + " |")
    big = [r for r in results if r.predicted_gap > 0.10]
    mean = sum(abs(r.ratio_error) for r in results) / len(results)
    return ("\n".join(lines) + f"\n\n{sum(r.ordered_right for r in big)} of {len(big)} pairs whose predicted gap is "
            f"over 10 % ordered right ({sum(r.ordered_right for r in results)} of {len(results)} in all); mean "
            f"|ratio error| {100 * mean:.1f} %, worst {100 * max(abs(r.ratio_error) for r in results):.1f} %. "
            f"{rounds} rounds, arms run A B A B ...; {wall_s:.0f} s.\n")


def ranking(out: Path, profile: dict, rounds: int = 5, steps: int = 12, warmup: int = 3, mode: str = "kernel",
            pairs: list[Pair] | None = None, say=print) -> tuple[list[PairResult], str]:
    t0 = time.time()
    res = run_ranking(pairs or PAIRS, rounds, out, case_predictor(profile, steps, warmup, mode),
                      case_runner(steps, warmup, mode), say)
    return res, ranking_markdown(res, rounds, time.time() - t0)
