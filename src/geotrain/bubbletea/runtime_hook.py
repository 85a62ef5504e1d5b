"""BubbleTea inside `geotrain train`: a rank fills its measured bubbles with prefill chunks.

The pipeline interpreter calls `fill_and_wait(index, work)` where it would block on a receive.
If the predictor gives that position a budget and the data is not there yet, the rank runs
prefill chunks that its fitted cost model says will end within the budget, then waits. The
predictor learns each position's idle time from what the rank measures, so the budgets follow
the real run (and shrink where a prefill ever ended after the data had arrived).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch

from geotrain.bubbletea.bubble_executor import BubbleWorker
from geotrain.bubbletea.inference import KVCache, forward_with_cache
from geotrain.bubbletea.model_source import load_inference_model
from geotrain.bubbletea.predictor import BubblePredictor
from geotrain.bubbletea.prefill_cost import PrefillCost
from geotrain.errors import GeotrainError
from geotrain.transport.auth import read_secret_file

log = logging.getLogger(__name__)


def profile_prefill_cost(model, lengths: tuple[int, ...] = (8, 24, 48), repeats: int = 3) -> PrefillCost:
    """Fit a + b*n + c*n^2 to a short profile of this process's prefill (a few ms on a tiny model)."""
    samples = []
    for n in lengths:
        toks = torch.randint(0, model.spec.vocab, (1, n))
        forward_with_cache(model, toks, KVCache())  # warm-up
        best = min(_timed(lambda t=toks: forward_with_cache(model, t, KVCache())) for _ in range(repeats))
        samples.append(((n,), best))
    fit = PrefillCost.fit(samples)
    # Never trust a fit below what was measured for the smallest chunk.
    return PrefillCost(max(fit.a, samples[0][1] * 0.5), fit.b, fit.c)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class BubbleHook:
    """duty: 0 fills every iteration; N > 0 alternates N steps without prefill and N with it
    (steps 1..N off, N+1..2N on, ...), so one run measures both side by side under the same
    machine state -- run-to-run noise here is several percent, the effect looked for is smaller."""

    def __init__(self, worker: BubbleWorker, predictor: BubblePredictor, recorder, duty: int = 0):
        self.worker, self.predictor, self.recorder, self.duty = worker, predictor, recorder, duty

    def filling(self) -> bool:
        return not self.duty or (max(0, self.recorder.iteration - 1) // self.duty) % 2 == 1

    def fill_and_wait(self, index: int, work, stage: int = -1) -> float:
        """Prefill inside the predicted bubble before action `index`, then wait for `work`.
        Returns the time the plain wait began (after any prefill)."""
        rec = self.recorder
        t_reach = rec.now()
        budget = self.predictor.budget(index) if self.filling() else 0.0
        done = getattr(work, "is_completed", None)
        used, chunks = 0.0, self.worker.chunks
        if budget > 0 and not (done and done()):
            try:
                used = self.worker.fill(budget)
            except (ConnectionError, OSError) as e:  # the service went away: training goes on
                log.warning("bubbletea: prefill service unreachable (%s); prefill disabled", e)
                self.worker.close()
            if used > 0 and self.worker.chunks > chunks:   # a poll answered "no work" is not prefill
                rec.add("prefill", t_reach, t_reach + used, stage=stage)
        arrived_during = bool(used > 0 and done and done())
        t_wait = rec.now()
        work.wait()
        self.worker.bubble_s += rec.now() - t_reach
        self.predictor.record(index, rec.now() - t_reach, data_was_waiting=arrived_during)
        return t_wait

    def end_iteration(self) -> None:
        self.predictor.next_iteration()

    def close(self) -> None:
        w = self.worker
        if w.chunks:
            print(f"bubbletea rank {w.rank}: {w.chunks} chunks, {w.busy_s * 1e3:.1f} ms of prefill "
                  f"({w.predicted_s * 1e3:.1f} ms predicted, slowdown now {w.slowdown:.2f}); fills ran "
                  f"{w.late_s * 1e3:.1f} ms past their budgets in all", file=sys.stderr, flush=True)
        w.close()


def make_hook(conf: dict[str, Any], rank: int, recorder) -> BubbleHook | None:
    """conf: {"address": [host, port] or a Unix socket path, "secret_file": the executor's 0600 secret,
    "inference_model": preset or HF dir,
    "margin_frac", "margin_s",
    "warmup_iterations", "priority", "duty", "device"}. Returns None (and logs why) when the service cannot be reached.

    priority: "idle" (default on CPU ranks) computes prefill on a SCHED_IDLE thread, since CPU ranks
    share cores; "normal" (default with CUDA, where the rank's own device is what idles) runs it in place."""
    try:     # first: without it the rank cannot join, and the model below would be loaded for nothing
        secret = read_secret_file(conf["secret_file"])
    except (KeyError, GeotrainError) as e:
        log.warning("bubbletea: no secret to join the prefill service with (%s)", e)
        return None
    model = load_inference_model(conf.get("inference_model", "tiny")).model   # the service's model, same weights
    model = model.to(conf.get("device", "cpu"))          # the rank's device (the runtime says which)
    cost = profile_prefill_cost(model)
    addr = conf["address"]
    priority = conf.get("priority") or ("normal" if torch.cuda.is_available() else "idle")
    worker = BubbleWorker(addr if isinstance(addr, str) else tuple(addr), rank, model, cost,
                          margin_s=float(conf.get("margin_s", 0.0)), priority=priority, secret=secret)
    try:
        worker.connect()
    except OSError as e:
        log.warning("bubbletea: cannot reach the prefill service at %s (%s)", conf["address"], e)
        return None
    predictor = BubblePredictor(margin_frac=float(conf.get("margin_frac", 0.3)),
                                margin_s=float(conf.get("margin_s", 0.002)),
                                warmup_iterations=int(conf.get("warmup_iterations", 2)))
    return BubbleHook(worker, predictor, recorder, duty=int(conf.get("duty", 0)))
