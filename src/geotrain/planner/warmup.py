"""The wan-1f1b warm-up: extra forwards a stage runs before its first backward so the WAN round
trips stay hidden (schedule.wan_warmup sizes it from the stage and boundary times), lowered until each
stage's activations fit its GPU.
"""

from __future__ import annotations

from geotrain.planner.chains import Layout
from geotrain.planner.context import PlanningContext
from geotrain.schedule.wan_warmup import wan_extra_warmup


def wanted_warmup(compute, bounds, m: int) -> tuple[int, ...]:
    """Extra warm-up forwards the WAN round trips call for (memory not yet considered)."""
    pp = len(compute)
    delays = [b.delay if b.wan else 0.0 for b in bounds]
    cap = [min(m, 4 * pp + 64)] * pp
    return tuple(wan_extra_warmup(pp, [c[0] for c in compute], [c[1] for c in compute], delays, cap))


def fit_warmup(ctx: PlanningContext, lay: Layout, chunks, wanted, sharding: str, ckpt: str) -> tuple[int, ...]:
    """Lower each stage's extra warm-up until its activations fit (memory is monotone in it),
    keeping the warm-up non-increasing along the pipeline as the builder requires."""
    dcs = lay.stage_dcs
    pp = lay.pp
    extra = list(wanted)
    for s in range(pp):
        base = pp - s
        lo, hi = 0, extra[s]
        if hi and not ctx.stage_fits(chunks[s], dcs[s], lay.micro_batch, min(lay.m, base + hi), sharding,
                                     lay.dp, ckpt):
            hi -= 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if ctx.stage_fits(chunks[s], dcs[s], lay.micro_batch, min(lay.m, base + mid), sharding,
                                  lay.dp, ckpt):
                    lo = mid
                else:
                    hi = mid - 1
            extra[s] = lo
    for s in range(pp - 1):
        extra[s + 1] = min(extra[s + 1], extra[s] + 1)
    return tuple(extra)
