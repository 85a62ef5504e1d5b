"""BubbleTea in simulation: a request stream placed into a simulated plan's bubbles.

Training is simulated first and never changed: prefill only goes where the trace says a
rank is idle, so every training action keeps its start time by construction -- and
`check_no_overlap` verifies it on the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import tomllib

from geotrain.bubbletea.bubbles import NOT_FILLABLE, Window, bubble_windows
from geotrain.bubbletea.prefill_cost import (
    PrefillCost,
    free_beside_training,
    inference_memory_bytes,
    models_that_fit,
)
from geotrain.bubbletea.scheduler import BubbleScheduler, Placement, Request
from geotrain.bubbletea.workload import Workload
from geotrain.console import human_bytes, human_seconds
from geotrain.errors import GeotrainError, SpecError
from geotrain.models.presets import PRESETS
from geotrain.trace.metrics import compute_metrics, trace_columns
from geotrain.trace.schema import TRAINING_COMPUTE_KINDS, Event, Trace


@dataclass
class BubbleTeaResult:
    period: float
    horizon: float
    requests: int
    served: int
    refused: int
    utilization_without: float
    utilization_with: float
    ttft_p50: float
    ttft_p99: float
    prefill_tokens_per_s: float
    placements: list[Placement] = field(default_factory=list)
    windows: dict[int, list[Window]] = field(default_factory=dict)

    def summary_rows(self) -> list[tuple[str, str]]:
        return [
            ("GPU utilization without BubbleTea", f"{self.utilization_without:.1%}"),
            ("GPU utilization with BubbleTea", f"{self.utilization_with:.1%}"),
            ("requests served / refused", f"{self.served} / {self.refused}"),
            ("TTFT p50 / p99", f"{human_seconds(self.ttft_p50)} / {human_seconds(self.ttft_p99)}"
             if self.served else "- (no request served)"),
            ("prefill tokens/s", f"{self.prefill_tokens_per_s:,.0f}"),
        ]


def run_bubbletea(trace: Trace, requests: list[Request], cost: PrefillCost, *, margin: float = 0.0,
                  min_chunk: int = 16, max_wait: float = float("inf"), period: float | None = None,
                  horizon: float | None = None) -> BubbleTeaResult:
    """Serve `requests` from the bubbles of every rank of `trace`."""
    windows, period = bubble_windows(trace, period=period)
    busy = compute_metrics(trace, 0).mean_utilization
    return run_windows(windows, period, requests, cost, margin=margin, min_chunk=min_chunk,
                       max_wait=max_wait, horizon=horizon, busy_fraction=busy)


def run_windows(windows: dict[int, list[Window]], period: float, requests: list[Request], cost: PrefillCost, *,
                margin: float = 0.0, min_chunk: int = 16, max_wait: float = float("inf"),
                horizon: float | None = None, busy_fraction: float | None = None) -> BubbleTeaResult:
    """Serve `requests` from given per-rank windows repeating every `period`.

    busy_fraction: the ranks' training-compute utilization; by default everything outside the
    windows counts as training compute."""
    if horizon is None:
        horizon = max((r.arrival for r in requests), default=0.0) + period
    ranks = max(1, len(windows))
    idle = sum(w.length for ws in windows.values() for w in ws) / ranks
    if busy_fraction is not None:
        util_without = busy_fraction
    else:
        util_without = (period - idle) / period if period > 0 else 0.0
    sched = BubbleScheduler(windows, period, cost, margin=margin, min_chunk=min_chunk, max_wait=max_wait)
    placements: list[Placement] = []
    refused = 0
    for req in requests:
        p = sched.place(req)
        if p is None:
            refused += 1
        else:
            placements.append(p)
    # Utilization over [0, horizon): training busy time + prefill inside the horizon.
    prefill_in = sum(max(0.0, min(c.end, horizon) - c.start) for p in placements for c in p.chunks
                     if c.start < horizon)
    util_with = util_without + prefill_in / (ranks * horizon) if horizon > 0 else util_without
    ttfts = np.array([p.ttft for p in placements]) if placements else np.array([0.0])
    tokens = sum(p.request.prompt_len for p in placements if p.finish <= horizon)
    return BubbleTeaResult(
        period=period, horizon=horizon, requests=len(requests), served=len(placements), refused=refused,
        utilization_without=util_without, utilization_with=min(1.0, util_with),
        ttft_p50=float(np.percentile(ttfts, 50)), ttft_p99=float(np.percentile(ttfts, 99)),
        prefill_tokens_per_s=tokens / horizon if horizon > 0 else 0.0,
        placements=placements, windows=windows,
    )


def prefill_events(result: BubbleTeaResult, iteration_start: float = 0.0,
                   until: float | None = None) -> list[Event]:
    """Prefill chunks as trace events (kind "prefill"), e.g. to draw them on the timeline."""
    out = []
    for p in result.placements:
        for c in p.chunks:
            if until is not None and c.start >= until:
                continue
            out.append(Event(rank=c.rank, kind="prefill", start=iteration_start + c.start,
                             end=iteration_start + c.end, mb=p.request.id, bytes=c.tokens))
    return out


def check_no_overlap(trace: Trace, result: BubbleTeaResult, fill_dp_reduction: bool = False) -> None:
    """Raise if any prefill chunk overlaps a training compute action (or, unless it may be
    filled, the DP reduction) of the same rank, with iteration 0 repeated every period."""
    cols = trace_columns(trace)
    sel = cols.iteration == 0
    t0 = float(cols.start[sel].min()) if sel.any() else 0.0
    comp = sel & cols.kind_mask(TRAINING_COMPUTE_KINDS if fill_dp_reduction else NOT_FILLABLE)
    used = {c.rank for p in result.placements for c in p.chunks}
    busy: dict[int, list[tuple[float, float]]] = {}
    for r, s, e in zip(cols.rank[comp].tolist(), cols.start[comp].tolist(), cols.end[comp].tolist()):
        if r in used:
            busy.setdefault(r, []).append((s - t0, e - t0))
    T = result.period
    for p in result.placements:
        for c in p.chunks:
            k = int(c.start // T)
            for base in (k * T, (k + 1) * T):
                for s, e in busy.get(c.rank, []):
                    if c.start < base + e - 1e-12 and base + s < c.end - 1e-12:
                        raise AssertionError(f"prefill of request {p.request.id} on rank {c.rank} "
                                             f"[{c.start:.6f}, {c.end:.6f}) overlaps training [{base + s:.6f}, "
                                             f"{base + e:.6f})")


# -- BubbleTea for a simulated plan ------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadConfig:
    """What `--bubbletea` takes: the request stream and how it is served.

    inference_model: a preset, or "auto" for the largest of INFERENCE_CHOICES that fits beside
    training on every rank; load: offered prefill work as a fraction of the bubbles' capacity
    (used when rate_per_s is not given); iterations: how long the stream lasts; max_wait_periods:
    admission control -- a request that cannot start within this many iterations is refused
    (the service's 429), which keeps TTFT bounded under overload."""

    inference_model: str = "auto"
    rate_per_s: float | None = None
    load: float = 1.0
    mean_prompt: int = 1024
    sigma: float = 0.6
    max_prompt: int = 4096
    seed: int = 0
    iterations: int = 5
    margin_frac: float = 0.02
    min_chunk: int = 32
    max_wait_periods: float = 1.0
    representative_replicas: int = 4
    fill_dp_reduction: bool = False


INFERENCE_CHOICES = ("llama2-13b", "llama2-7b", "small", "tiny")
# Requests one simulation samples and places (each costs ~0.1 ms and a few hundred bytes; the
# [bubbletea] upper bounds together asked for 10**9: minutes and gigabytes).
MAX_SIMULATED_REQUESTS = 20_000
def parse_workload(arg: str | None, spec_table: dict | None = None) -> WorkloadConfig:
    """`--bubbletea` accepts a TOML file, "key=value,key=value", or "spec" (the experiment's
    [bubbletea] table). Unknown keys are errors."""


    known = {f.name: f.type for f in fields(WorkloadConfig)}
    where = arg or "spec"
    if arg in (None, "", "spec"):
        raw = dict(spec_table or {})
    elif Path(arg).is_file():
        try:
            raw = tomllib.loads(Path(arg).read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise SpecError(arg, "", f"not valid TOML ({' '.join(str(e).split())[:200] or 'nested too deeply'})") \
                from None
        if not isinstance(raw.get("bubbletea", raw), dict):
            raise SpecError(arg, "bubbletea", "must be a table")
        raw = raw.get("bubbletea", raw)
    else:
        raw = {}
        for part in arg.split(","):
            key, sep, val = part.partition("=")
            if not sep:
                raise SpecError("--bubbletea", part, "expected key=value (or a TOML file)")
            raw[key.strip()] = val.strip()
    out = {}
    for key, val in raw.items():
        if key not in known:
            raise SpecError(where, key, f"unknown key (known: {', '.join(known)})")
        typ = str(known[key])
        try:
            if "bool" in typ:
                if str(val).lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = str(val).lower() in ("true", "1")
            elif "float" in typ:
                out[key] = float(val)
            elif "int" in typ:
                out[key] = int(val)
            else:
                out[key] = str(val)
        except (ValueError, TypeError, OverflowError):
            raise SpecError(where, key, f"not a valid {typ}: {val!r:.60}") from None
    cfg = WorkloadConfig(**out)
    problem = _workload_problem(cfg)
    if problem:
        raise SpecError(where, problem[0], problem[1])

    if cfg.inference_model != "auto" and cfg.inference_model not in PRESETS:
        raise SpecError(where, "inference_model", f"unknown preset {cfg.inference_model!r}")
    return cfg


def _workload_problem(cfg: WorkloadConfig) -> tuple[str, str] | None:
    """(key, reason) for the first out-of-range workload value. Negative rates or sigma crashed
    numpy's samplers; zero prompts, iterations or chunks served nothing and reported 0 ms TTFT."""
    # Upper bounds too: the simulated request stream is sampled up front (load = 1e12 asked numpy
    # for petabytes), so each value stays within what a service could meet.
    checks = [
        ("rate_per_s", cfg.rate_per_s is None or (math.isfinite(cfg.rate_per_s) and 0 < cfg.rate_per_s <= 1e5),
         "in (0, 1e5] requests/s"),
        ("load", math.isfinite(cfg.load) and 0 < cfg.load <= 100, "in (0, 100] (x the bubbles' capacity)"),
        ("mean_prompt", 1 <= cfg.mean_prompt <= 2**20, "in 1..2**20 tokens"),
        ("sigma", math.isfinite(cfg.sigma) and 0 <= cfg.sigma <= 10, "in [0, 10]"),
        ("max_prompt", 1 <= cfg.max_prompt <= 2**20, "in 1..2**20 tokens"),
        ("iterations", 1 <= cfg.iterations <= 10_000, "in 1..10000"),
        ("margin_frac", 0 <= cfg.margin_frac < 1, "in [0, 1)"),
        ("min_chunk", 1 <= cfg.min_chunk <= 2**20, "in 1..2**20 tokens"),
        ("max_wait_periods", math.isfinite(cfg.max_wait_periods) and 0 <= cfg.max_wait_periods <= 1e4,
         "in [0, 1e4]"),
        ("representative_replicas", 1 <= cfg.representative_replicas <= 1024, "in 1..1024"),
        ("seed", 0 <= cfg.seed < 2**63, "in 0..2**63-1"),
    ]
    for key, ok, want in checks:
        if not ok:
            return key, f"must be {want} (got {getattr(cfg, key)!r})"
    return None


@dataclass
class PlanBubbleTea:
    result: BubbleTeaResult
    config: WorkloadConfig
    inference_model: str
    ranks_simulated: list[int]
    ranks_without_room: list[int]          # inference model + KV cache do not fit beside training
    headroom_bytes: dict[int, float]
    models_that_fit: list[str]


def bubbletea_for_plan(spec, sim_result, cfg: WorkloadConfig) -> PlanBubbleTea:
    """Serve `cfg`'s request stream from the bubbles of a simulated plan.

    A tensor-parallel group serves as one prefill unit (the inference model split the same way,
    so prefill runs tp times faster). Replicas of a stage see the same bubbles (up to the
    temporal-sharing stagger), so the stream is served by `representative_replicas` replicas of
    every stage, with the arrival rate scaled to their share: utilization and TTFT are per-GPU
    quantities and carry over, while the scheduler's cost stays independent of cluster size."""
    plan, trace, metrics = sim_result.plan, sim_result.trace, sim_result.metrics
    period = metrics.iteration_time
    windows, _ = bubble_windows(trace, period=period, fill_dp_reduction=cfg.fill_dp_reduction)
    reps = min(plan.dp, cfg.representative_replicas)
    chosen = [plan.rank(s, d, 0) for s in range(plan.pp) for d in range(reps)]
    headroom = {r: free_beside_training(spec, plan, r, metrics.peak_memory.get(r, 0.0)) for r in chosen}
    fit = models_that_fit(min(headroom.values()), cfg.max_prompt, PRESETS)
    if cfg.inference_model == "auto":
        name = next((m for m in INFERENCE_CHOICES if m in fit), INFERENCE_CHOICES[-1])
    else:
        name = cfg.inference_model
    infer = PRESETS[name]
    need = inference_memory_bytes(infer, cfg.max_prompt, "bf16")
    no_room = [r for r in chosen if headroom[r] < need]
    serving = {r: windows.get(r, []) for r in chosen if r not in no_room}
    if not serving:
        raise GeotrainError(f"inference model {name} needs {human_bytes(need)} for a {cfg.max_prompt}-token prompt, "
                            f"more than any GPU has beside training (least headroom "
                            f"{human_bytes(min(headroom.values()))}); models that fit: {', '.join(fit) or 'none'}")
    gpu0 = spec.cluster.gpu(spec.cluster.dc(plan.stages[0].dc).gpu_type)
    base = PrefillCost.from_flops(infer, gpu0)
    cost = PrefillCost(base.a, base.b / plan.tp, base.c / plan.tp)
    horizon = cfg.iterations * period
    if cfg.rate_per_s is not None:
        rate = cfg.rate_per_s * len(serving) * plan.tp / max(1, plan.num_ranks)
    else:
        idle = sum(w.length for ws in serving.values() for w in ws) / period  # unit-seconds per second
        mean_time = cost.prompt_time([cfg.mean_prompt])
        rate = cfg.load * idle / mean_time if mean_time > 0 else 0.0
    if rate * horizon > MAX_SIMULATED_REQUESTS:     # sampled and placed one by one: bound time and memory
        raise GeotrainError(f"the [bubbletea] workload asks for ~{rate * horizon:,.0f} prefill requests over "
                            f"{cfg.iterations} simulated iterations ({rate:,.4g}/s on the simulated GPUs); at most "
                            f"{MAX_SIMULATED_REQUESTS:,} are simulated: lower load, rate_per_s or iterations")
    wl = Workload(rate_per_s=rate, mean_prompt=cfg.mean_prompt, sigma=cfg.sigma, max_prompt=cfg.max_prompt,
                  seed=cfg.seed)
    margin = cfg.margin_frac * period / max(1, plan.num_microbatches)
    busy = metrics.busy_fraction
    res = run_windows(serving, period, wl.requests(horizon), cost, margin=margin, min_chunk=cfg.min_chunk,
                      max_wait=cfg.max_wait_periods * period, horizon=horizon,
                      busy_fraction=sum(busy[r] for r in serving) / max(1, len(serving)))
    if no_room:  # ranks that cannot host the inference model keep their training utilization only
        n, busy_np = len(chosen), sum(busy[r] for r in no_room)
        res.utilization_without = (res.utilization_without * len(serving) + busy_np) / n
        res.utilization_with = (res.utilization_with * len(serving) + busy_np) / n
    return PlanBubbleTea(res, cfg, name, sorted(serving), no_room, headroom, fit)
