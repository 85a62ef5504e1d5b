"""How many extra warm-up forwards the WAN-aware 1F1B gives each stage.

In 1F1B, stage s warms up with exactly enough forwards (pp - 1 - s) to stay busy until the
gradient of its first micro-batch comes back -- if transfers are free. A WAN link downstream of
s adds its one-way latency twice to that round trip (activation out, gradient back), and the
stage idles for that long every time unless it has more micro-batches in flight. One extra
in-flight micro-batch covers one steady-state step (the pipeline's period, set by its slowest
stage: max over stages of forward + backward), so stage s needs

    ceil(2 * sum of one-way latencies of the links after s / period)

extra warm-up forwards, as long as their activations fit in memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from geotrain.schedule.schedule_error import ScheduleError


def wan_extra_warmup(pp: int, stage_times_f: Sequence[float], stage_times_b: Sequence[float],
                     link_latency_s_after_stage: Sequence[float], max_inflight: Sequence[int]) -> list[int]:
    """Extra warm-up forwards per physical stage for build_schedule("wan-1f1b", ...).

    stage_times_f, stage_times_b: per stage, seconds per micro-batch (backward = full backward).
    link_latency_s_after_stage: one-way latency (s) of the link between stage s and s + 1;
        pp - 1 entries (a pp-th, for the last stage, is ignored). 0 for links inside a DC.
    max_inflight: per stage, the most micro-batches whose activations fit in memory at once.
        1F1B already holds pp - s on stage s, so the extra is capped at max_inflight[s] - (pp - s)
        (never below 0): with the result, stage s holds at most max(pp - s, max_inflight[s]).
    The result is then lowered where needed so the warm-up never grows along the pipeline
    (extra[s+1] <= extra[s] + 1), which the builder requires to stay deadlock-free.
    """
    if pp < 1:
        raise ScheduleError("pp must be >= 1")
    for name, seq in (("stage_times_f", stage_times_f), ("stage_times_b", stage_times_b),
                      ("max_inflight", max_inflight)):
        if len(seq) != pp:
            raise ScheduleError(f"{name} has {len(seq)} entries, expected {pp}")
    if len(link_latency_s_after_stage) not in (pp - 1, pp):
        raise ScheduleError(f"link_latency_s_after_stage has {len(link_latency_s_after_stage)} entries, "
                         f"expected {pp - 1} (one per link between consecutive stages)")
    lat = [float(x) for x in link_latency_s_after_stage[: pp - 1]]
    if any(x < 0 for x in lat):
        raise ScheduleError("link latencies must be >= 0")
    period = max(float(f) + float(b) for f, b in zip(stage_times_f, stage_times_b))
    if period <= 0:
        raise ScheduleError("stage times must be positive")

    extra = []
    for s in range(pp):
        round_trip = 2.0 * sum(lat[s:])
        want = math.ceil(round_trip / period - 1e-9) if round_trip > 0 else 0
        cap = max(0, int(max_inflight[s]) - (pp - s))
        extra.append(min(want, cap))
    for s in range(pp - 1):
        extra[s + 1] = min(extra[s + 1], extra[s] + 1)
    return extra
