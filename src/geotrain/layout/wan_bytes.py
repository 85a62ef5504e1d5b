"""The WAN bytes a plan moves per iteration, per link direction: the one definition the egress
price (`layout.price`), `plan`/`simulate`'s printed WAN bytes and the report's predicted row read.

It counts what crosses a DC boundary: pipeline activations and gradients (one copy per receiving
TP rank, as the simulator's transfer events carry them); a region plan's DP sync over the ring of
its DCs, with every collective `costs.comm.sync_collectives` says the runtime runs; the tied
embedding's gradient sum; the step's control all-reduces (loss, fp16's overflow flag); and the
gradient norm's exchange. docs/DECISIONS.md (WAN bytes) has the check against an emulated run's
router counters.
"""

from __future__ import annotations

from geotrain.costs import CostModel
from geotrain.costs.comm import pipeline_chain, tied_route
from geotrain.costs.compression import boundary_wire_bytes
from geotrain.layout.outer_cost import exchange_bytes
from geotrain.layout.plan import Plan
from geotrain.spec.load import Spec

Direction = tuple[str, str]   # (sending DC, receiving DC)
LOSS_SUM_BYTES = 8            # bf16/fp32: the loss (float64) summed over the last stage's DP group per iteration
OVERFLOW_BYTES = 16           # fp16: the overflow flag and the loss (2 x float64) over the world per iteration
NORM_BYTES = 8                # the gradient norm's squared sum (float64), per message of its exchange


def predicted_link_bytes(spec: Spec, plan: Plan, iterations: int, backend: str = "nccl") -> dict[str, dict[str, int]]:
    """Per DC, the bytes `iterations` iterations send ("out") and receive ("in") over the WAN --
    the shape of RUN_DIR/wan_bytes.json, to print beside what the emulated links counted."""
    out: dict[str, dict[str, int]] = {}
    for (a, b), nbytes in wan_bytes_per_direction(spec, plan, backend).items():
        out.setdefault(a, {"out": 0, "in": 0})["out"] += int(nbytes * iterations)
        out.setdefault(b, {"out": 0, "in": 0})["in"] += int(nbytes * iterations)
    return out


def _cost(spec: Spec, plan: Plan) -> CostModel:
    return CostModel(spec.model, precision=plan.precision, checkpointing="none", optimizer=spec.job.optimizer)


def _add(out: dict[Direction, float], a: str, b: str, nbytes: float) -> None:
    if a != b and nbytes:
        out[(a, b)] = out.get((a, b), 0.0) + nbytes


def boundary_message_bytes(plan: Plan, sender: int, receiver: int, nbytes: int, elem_bytes: int, row: int) -> int:
    """Bytes one boundary tensor of `nbytes` (in the training precision, `elem_bytes` per value)
    puts on the wire from physical stage `sender` to `receiver`, every copy or slice counted
    (Plan.boundary_copies), compressed where the link between their DCs says so
    (LinkPlan.compression / rank, costs.compression: what runtime.compress encodes)."""
    copies = plan.boundary_copies(sender, receiver)
    a, b = plan.stages[sender].dc, plan.stages[receiver].dc
    lp = plan.link_between(a, b) if a != b else None
    if lp is None or (lp.compression == "none" and lp.rank == 0):
        return nbytes * copies
    numel = nbytes // elem_bytes
    if plan.boundary_scattered(sender, receiver):     # tp slices of ceil(numel / tp) values each
        tp = plan.stage_tp(sender)
        return tp * boundary_wire_bytes(-(-numel // tp), elem_bytes, lp.compression, row, lp.rank)
    return copies * boundary_wire_bytes(numel, elem_bytes, lp.compression, row, lp.rank)


def pipeline_bytes(spec: Spec, plan: Plan) -> dict[Direction, float]:
    """Activations forward and their gradients back across DC boundaries, per iteration (as
    compressed as each link's plan says)."""
    cost = _cost(spec, plan)
    out: dict[Direction, float] = {}
    pp, nv = plan.pp, plan.pp * plan.virtual_per_stage
    one = cost.boundary_bytes(plan.micro_batch)
    per = plan.dp * plan.num_microbatches
    for v in range(nv - 1):   # virtual stage v hands over to v + 1
        a, b = v % pp, (v + 1) % pp
        for x, y in ((a, b), (b, a)):
            _add(out, plan.stages[x].dc, plan.stages[y].dc,
                 per * boundary_message_bytes(plan, x, y, one, cost.dtype_bytes, spec.model.hidden))
    return out


def sync_collectives(spec: Spec, plan: Plan, backend: str = "nccl") -> list[tuple[str, float]]:
    """(what, bytes of the whole stage summed over its TP slices) of each reduce-scatter and
    all-gather one DP group runs per iteration, for every stage: costs.comm.sync_collectives, the
    definition the simulator's and the planner's sync time count too (replicate/zero1 an
    all-reduce; zero2/zero3 FSDP2's reduce-scatter per chunk and its parameter gathers, zero3's
    m+1 of them: comm.fsdp_gathers). backend "gloo" (the ranks of a CPU run): gloo's
    reduce-scatter is an all-reduce on the wire, so it counts twice."""
    cost = _cost(spec, plan)
    out: list[tuple[str, float]] = []
    for st in plan.stages:
        out += cost.sync_collectives([range(a, b) for a, b in st.chunks], plan.sharding, plan.num_microbatches,
                                     backend=backend)
    return out


def collective_bytes(spec: Spec, plan: Plan, backend: str = "nccl") -> dict[Direction, float]:
    """The collectives' WAN bytes per iteration: a region plan's DP sync over the ring of its
    DCs, the step's control all-reduce (the loss; fp16's overflow flag), and the tied embedding's
    gradient sum where its first and last stage sit apart."""
    out: dict[Direction, float] = {}
    if plan.replica_dcs and plan.dp > 1:
        ring = [d for d, _ in plan.replicas_per_dc()]
        k = len(ring)
        total = sum(nbytes for _, nbytes in sync_collectives(spec, plan, backend))
        for i in range(k):
            _add(out, ring[i], ring[(i + 1) % k], (k - 1) / k * total)
    clips = spec.job.grad_clip > 0
    control = LOSS_SUM_BYTES if plan.precision != "fp16" else OVERFLOW_BYTES + NORM_BYTES * clips
    ring = plan.dcs_by_rank() if plan.precision == "fp16" else \
        list(dict.fromkeys(plan.dc_of(plan.pp - 1, d) for d in range(plan.dp)))
    _ring(out, ring, control)
    if clips and plan.precision != "fp16":
        for s in range(plan.pp):          # the stage's scalar all-reduce (crosses DCs on a region plan)
            _ring(out, list(dict.fromkeys(plan.dc_of(s, d) for d in range(plan.dp))), NORM_BYTES)
        for s in range(plan.pp - 1):      # the sums down to stage 0, the total back up
            for d in range(plan.dp):
                a, b = plan.dc_of(s, d), plan.dc_of(s + 1, d)
                _add(out, b, a, NORM_BYTES * plan.stage_tp(s))
                _add(out, a, b, NORM_BYTES * plan.stage_tp(s + 1))
    nbytes = _cost(spec, plan).tied_grad_bytes(plan.sharding, plan.dp)
    if nbytes and plan.pp > 1:
        pairs = plan.dp * min(plan.stage_tp(0), plan.stage_tp(plan.pp - 1))
        for link in tied_route(spec.cluster.link, pipeline_chain(st.dc for st in plan.stages)):
            a, b = link.between
            _add(out, a, b, pairs * nbytes)
            _add(out, b, a, pairs * nbytes)
    return out


def _ring(out: dict[Direction, float], ring: list[str], nbytes: float) -> None:
    """A ring all-reduce of `nbytes` over DCs `ring`: 2 (k-1)/k of them on each hop."""
    for i in range(len(ring) if len(ring) > 1 else 0):
        _add(out, ring[i], ring[(i + 1) % len(ring)], 2 * (len(ring) - 1) / len(ring) * nbytes)


def wan_bytes_per_direction(spec: Spec, plan: Plan, backend: str = "nccl") -> dict[Direction, float]:
    """Every WAN byte the plan sends per iteration, per (from DC, to DC); backend: the DP
    collectives' (nccl on GPUs, the planner's and the price's; gloo for a CPU run's ranks). A
    DiLoCo plan: every worker's, plus the outer exchanges' share of an inner step (layout.outer_cost)."""
    if plan.outer is not None:
        out: dict[Direction, float] = {}
        for w in range(plan.num_workers):
            for key, nbytes in wan_bytes_per_direction(spec, plan.worker_plan(w).inner_plan(), backend).items():
                _add(out, *key, nbytes)
        if plan.num_workers > 1:
            per_step = plan.outer.fragments / plan.outer.inner_steps
            for key, nbytes in exchange_bytes(_cost(spec, plan), plan)[0].items():
                _add(out, *key, nbytes * per_step)
        return out
    out = pipeline_bytes(spec, plan)
    for key, nbytes in collective_bytes(spec, plan, backend).items():
        _add(out, *key, nbytes)
    return out
