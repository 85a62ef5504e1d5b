"""The planner's checkpointing choice per stage.

A layout is scored under the lightest checkpointing mode with which every stage fits
(`scorer.Scorer.score`); then each stage gets the mode -- no heavier -- with the shortest step that
fits its own memory. Under 1F1B stage s holds pp - s micro-batches, so the first stages may need
recompute that the last do not, and a plan-wide mode would make every stage pay for the first's.
"""

from __future__ import annotations

from geotrain.costs.activations import SELECTIVE
from geotrain.planner.analytic import held


def stage_modes(scorer, lay, kind: str, v: int, ckpt: str, chunks, sharding: str, extra) -> tuple[str, ...]:
    """Per stage, the mode no heavier than `ckpt` (in the job's options, lightest first) whose step
    (forward + backward with its recompute, `scorer.compute_costs`) is shortest among those that
    fit the stage's GPU with what the schedule holds there; ties go to the lighter. () when every
    stage keeps `ckpt`. Selective policies are left out under ZB-H1 (its split backward runs twice
    through a checkpointed region, which PyTorch's selective checkpointing refuses)."""
    ctx = scorer.ctx
    options = ctx.checkpointing_options()
    lighter = options[:options.index(ckpt)] if ckpt in options else ()
    if kind == "zb-h1":
        lighter = tuple(md for md in lighter if md not in SELECTIVE)
    if not lighter:
        return ()
    dcs, mb = lay.stage_dcs, lay.micro_batch
    costs = {md: scorer.compute_costs(dcs, chunks, mb, md) for md in (*lighter, ckpt)}   # one lookup a mode
    modes = []
    for s in range(lay.pp):
        k = held(kind, lay.pp, lay.m, s, extra, v)
        fits = [md for md in lighter if ctx.stage_fits(chunks[s], dcs[s], mb, k, sharding, lay.dp, md)]
        candidates = (*fits, ckpt)
        times = {md: sum(costs[md][s][:2]) for md in candidates}
        modes.append(min(candidates, key=lambda md: times[md]))
    return () if all(md == ckpt for md in modes) else tuple(modes)
