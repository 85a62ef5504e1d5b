"""/metrics in Prometheus text format through `prometheus_client`: the service's own counters
and, when it serves beside a training run, that run's progress.

A custom collector builds every family at scrape time from the service's `Stats`, the
executor's prefill accounting and the last line of the run's `losses.jsonl` (rank 0 appends one
per step): nothing is updated on the request path, and each service has its own registry.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def tail_rows(losses: Path) -> list[dict]:
    """The complete rows at the end of a losses.jsonl (read from its end: the file grows every step)."""
    try:
        with open(losses, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().split(b"\n")
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def last_step(losses: Path) -> dict | None:
    """The last complete line of a losses.jsonl."""
    rows = tail_rows(losses)
    return rows[-1] if rows else None


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class ServiceCollector:
    def __init__(self, svc):
        self.svc = svc

    def collect(self):
        svc, s = self.svc, self.svc.stats
        with s.lock:
            ttfts = sorted(s.ttfts)
            responses = dict(s.responses)
            in_flight, prompt_tokens, completion_tokens = s.in_flight, s.prefill_tokens, s.completion_tokens
            up = max(1e-9, time.monotonic() - s.t0)
            disconnects = s.disconnects
        p = "geotrain_bubbletea_"
        yield GaugeMetricFamily(p + "queue_length", "Accepted requests not yet answered.", value=in_flight)
        c = CounterMetricFamily(p + "responses", "Responses by HTTP status.", labels=["code"])
        for code, n in sorted(responses.items()):
            c.add_metric([str(code)], n)
        yield c
        buckets = [(str(b), sum(1 for t in ttfts if t <= b)) for b in TTFT_BUCKETS] + [("+Inf", len(ttfts))]
        yield HistogramMetricFamily(p + "ttft_seconds", "Time to first token.", buckets=buckets, sum_value=sum(ttfts))
        q = GaugeMetricFamily(p + "ttft_quantile_seconds", "Time to first token, quantiles of every request.",
                              labels=["quantile"])
        for x in (0.5, 0.99):
            q.add_metric([str(x)], quantile(ttfts, x))
        yield q
        yield CounterMetricFamily(p + "prefill_tokens", "Prompt tokens prefilled.", value=prompt_tokens)
        yield CounterMetricFamily(p + "completion_tokens", "Tokens generated.", value=completion_tokens)
        yield CounterMetricFamily(p + "client_disconnects", "Clients gone before their answer ended.",
                                  value=disconnects)
        yield GaugeMetricFamily(p + "prefill_tokens_per_second", "Mean prefill tokens/s since start.",
                                value=prompt_tokens / up)
        ex = svc.executor
        share = ex.utilization_gained()
        yield GaugeMetricFamily(p + "utilization_gained", "Fraction of the ranks' time used by prefill.", value=share)
        yield GaugeMetricFamily(p + "prefill_share", "Prefill's share of the training ranks' time (the same "
                                "fraction as utilization_gained).", value=share)
        bubble = getattr(ex, "bubble_seconds", None)
        if bubble is not None:
            prefill_s, bubble_s = bubble()
            yield GaugeMetricFamily(p + "bubble_fill", "Fraction of the ranks' measured bubble time that ran "
                                    "prefill.", value=prefill_s / bubble_s if bubble_s > 0 else 0.0)
        yield from self._training()

    def _training(self):
        if not self.svc.run_dir:
            return
        rows = tail_rows(Path(self.svc.run_dir) / "losses.jsonl")
        if not rows:
            return
        row = rows[-1]
        p = "geotrain_train_"
        dt = float(row.get("step_time_s") or 0.0)
        yield GaugeMetricFamily(p + "step", "Last optimizer step finished.", value=float(row["step"]))
        gauges = (("loss", "loss", "Training loss of the last step."),
                  ("lr", "learning_rate", "Learning rate of the last step."),
                  ("grad_norm", "grad_norm", "Global gradient norm of the last step, before clipping."))
        for key, name, doc in gauges:
            v = _number(row.get(key))
            if v is not None:           # a NaN loss (null) or clipping off: no sample rather than a wrong one
                yield GaugeMetricFamily(p + name, doc, value=v)
        yield GaugeMetricFamily(p + "step_time_seconds", "Wall time of the last step.", value=dt)
        yield GaugeMetricFamily(p + "tokens_per_second", "Training tokens/s of the last step.",
                                value=float(row.get("tokens", 0)) / dt if dt > 0 else 0.0)
        evals = [r for r in rows if _number(r.get("eval_loss")) is not None]
        if evals:
            self.last_eval = evals[-1]      # kept: the next evaluation may be further back than the tail
        ev = getattr(self, "last_eval", None)
        if ev is not None:
            yield GaugeMetricFamily(p + "eval_loss", "Held-out loss at the last evaluation.",
                                    value=float(ev["eval_loss"]))
            yield GaugeMetricFamily(p + "eval_perplexity", "Held-out perplexity at the last evaluation.",
                                    value=math.exp(min(float(ev["eval_loss"]), 50.0)))
            yield GaugeMetricFamily(p + "eval_step", "Step of the last evaluation.", value=float(ev["step"]))


def metrics_text(svc) -> bytes:
    registry = getattr(svc, "_registry", None)
    if registry is None:
        registry = svc._registry = CollectorRegistry(auto_describe=False)
        registry.register(ServiceCollector(svc))
    return generate_latest(registry)
