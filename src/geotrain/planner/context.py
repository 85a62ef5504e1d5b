"""Cached cost look-ups for the planner.

The search asks the same questions many times (the time of units a..b on an H100 at micro-batch
2, the memory of that stage under ZeRO-1 at dp=64, ...). Per-unit times are turned once into
prefix sums per (GPU type, micro-batch, checkpointing), so a stage's time is two subtractions;
memory, all-reduce and optimizer answers are memoised. Times and bytes come from the one cost
interface, `layout.stage_costs.StageCosts` (the simulator's too), memory from its
`costs.CostModel`; nothing here models hardware itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from geotrain.costs import CostModel, comm
from geotrain.layout.stage_costs import StageCosts
from geotrain.layout.tp_check import split_widths
from geotrain.planner.split import prefix_sums
from geotrain.spec.cluster import Datacenter, GPUType, WanLink
from geotrain.spec.load import Spec

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

CHECKPOINTING_ORDER = ("none", "selective", "keep-matmul", "keep-attention", "full")  # lightest recompute first
SHARDING_ORDER = ("replicate", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class UnitTable:
    """Prefix sums of per-unit seconds per micro-batch on one GPU type."""

    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    backward_weight: list[float]
    step: list[float]  # forward + backward

    def times(self, a: int, b: int) -> tuple[float, float, float, float]:
        return (self.forward[b] - self.forward[a], self.backward[b] - self.backward[a],
                self.backward_input[b] - self.backward_input[a],
                self.backward_weight[b] - self.backward_weight[a])


def tp_options(spec: Spec) -> tuple[int, ...]:
    """The tensor-parallel degrees the planner tries somewhere: the job's, or with tp = "auto"
    every power of two that splits the model's heads, KV heads and FFN evenly and fits a node of
    some DC (`tp_assignments` gives each DC its own)."""
    if isinstance(spec.job.tp, int):
        return (spec.job.tp,)
    widest = max(d.gpus_per_node for d in spec.cluster.datacenters)
    return _model_tps(spec, widest)


def _model_tps(spec: Spec, node: int) -> tuple[int, ...]:
    """Powers of two up to `node` that divide the node, the heads, the KV heads and the FFN."""
    widths = [n for _, n in split_widths(spec.model)]
    out, t = [], 1
    while t <= node:
        if not (node % t or any(n % t for n in widths)):
            out.append(t)
        t *= 2
    return tuple(out)


def dc_kind(dc: Datacenter) -> tuple[str, int]:
    """What decides a DC's tensor-parallel degree: its GPU type and node size. DCs alike in both
    run one tp (two zones of H100 nodes are one choice, not two)."""
    return dc.gpu_type, dc.gpus_per_node


def dcs_by_kind(spec: Spec) -> dict[tuple[str, int], list[str]]:
    """The cluster's DC names grouped by `dc_kind`, in the cluster's order."""
    kinds: dict[tuple[str, int], list[str]] = {}
    for d in spec.cluster.datacenters:
        kinds.setdefault(dc_kind(d), []).append(d.name)
    return kinds


def tp_assignments(spec: Spec) -> list[dict[str, int]]:
    """The per-DC tensor-parallel degrees the planner tries, the all-smallest first.

    A pinned `job.tp` is every DC's. With tp = "auto" each kind of DC (`dc_kind`) gets every
    degree that fits its node and the model, independently: a stage runs its DC's tp, so where
    GPU types or node sizes differ the stages of one plan may differ (8 on 8-GPU H100 nodes,
    2 on 2-GPU nodes). One tp per kind, not per stage: the stages of one kind of DC see the same
    costs, and the product over kinds stays small (one kind: one context per tp, as before)."""
    if isinstance(spec.job.tp, int):
        return [{d.name: spec.job.tp for d in spec.cluster.datacenters}]
    out: list[dict[str, int]] = [{}]
    for kind, names in dcs_by_kind(spec).items():
        out = [{**a, **{n: t for n in names}} for a in out for t in _model_tps(spec, kind[1])]
    return out


EP_KEY = "#ep"     # a context key's entry for its expert-parallel degree (no DC is named so)


def ep_options(spec: Spec) -> tuple[int, ...]:
    """The expert-parallel degrees the planner tries: 1 for a dense model; the job's; or with
    ep = "auto" every power of two that divides the experts and fits a DC's GPUs (an EP group is
    ep replicas of a stage inside its DC: its all-to-alls never cross the WAN)."""
    experts = getattr(spec.model, "experts", 0)
    if not experts:
        return (1,)
    if isinstance(spec.job.ep, int):
        return (spec.job.ep,)
    most = max(d.gpus for d in spec.cluster.datacenters)
    out, e = [], 1
    while e <= min(experts, most):
        if experts % e == 0:
            out.append(e)
        e *= 2
    return tuple(out)


def planning_contexts(spec: Spec, profile: dict | None = None, mixed_tp: bool = True) -> list[PlanningContext]:
    """One context per tensor-parallel choice the planner scans, the all-smallest first: per
    assignment of tp to the kinds of DC (`tp_assignments`), or with mixed_tp=False -- and for a
    tied model, whose first and last stage's copies the runtime sums TP index by TP index -- one
    tp for every stage (`tp_options`); for a mixture of experts, each at every `ep_options` degree
    (one tp for every stage: the runtime's EP needs it)."""
    eps = ep_options(spec)
    if eps != (1,):
        return [PlanningContext(spec, profile, tp=t, ep=e) for t in tp_options(spec) for e in eps]
    if mixed_tp and not getattr(spec.model, "tie_embeddings", False):
        return [PlanningContext(spec, profile, tps=t) for t in tp_assignments(spec)]
    return [PlanningContext(spec, profile, tp=t) for t in tp_options(spec)]


class PlanningContext:
    """profile: measured per-unit times (geotrain.costs.unit_times) replacing the FLOP estimate;
    tp: the tensor-parallel degree of the layouts this context prices (default: the job's, 1
    when the job leaves it to the planner); tps: one per DC instead (tp_assignments), every
    cost of a stage then at its DC's tp. `tp` is then the smallest (the plan-wide rules: ZeRO-1
    is out when any DC runs tp > 1)."""

    def __init__(self, spec: Spec, profile: dict | None = None, tp: int | None = None,
                 tps: dict[str, int] | None = None, ep: int = 1):
        self.spec = spec
        self.profile = profile
        self.cluster = spec.cluster
        self.model = spec.model
        self.job = spec.job
        self.num_units = spec.model.num_units
        tp = tp if tp is not None else (spec.job.tp if isinstance(spec.job.tp, int) else 1)
        self.tps = dict(tps) if tps else {d.name: tp for d in spec.cluster.datacenters}
        self.tp = min(self.tps.values()) if tps else tp
        self.widest_tp = max(self.tps.values())
        self.uniform_tp = len(set(self.tps.values())) == 1
        self.ep = ep     # expert parallelism: layouts whose dp it does not divide are not this context's
        # what tells two contexts' costs apart
        self.key = tuple(sorted(self.tps.items())) + (((EP_KEY, ep),) if ep > 1 else ())
        # The kinds of DC whose tp is not their smallest option: a chain without any of them is
        # listed by the context where they are at the smallest (tp_assignments' first), once.
        # One tp given: every layout whose DCs' nodes it fits is this context's (tp_fits).
        smallest = tp_assignments(spec)[0] if tps else self.tps
        self._raised = [names for names in dcs_by_kind(spec).values()
                        if self.tps[names[0]] != smallest.get(names[0])]
        self.costs = StageCosts(CostModel(self.model, precision=self.job.precision, checkpointing="none",
                                          optimizer=self.job.optimizer, profile=profile, ep=ep), spec.cluster)
        self._tables: dict[tuple[str, int, str, int], UnitTable] = {}
        self._dc_tables: dict[tuple[str, int, str], UnitTable] = {}
        self._memo: dict[tuple, float] = {}
        self._shapes: dict[tuple, tuple[int, int, int]] = {}
        self.memory_calls = 0
        self._gpus = {d.name: spec.cluster.gpu(d.gpu_type) for d in spec.cluster.datacenters}

    def for_plan(self, plan) -> PlanningContext:
        """A context pricing `plan`'s stages at their own tp: this one when they agree, else a
        new one (a DC's stages are priced at the first one's tp; the planner gives all of a DC's
        stages one)."""
        tps = dict(self.tps)
        for d in plan.replica_dcs:
            tps[d] = plan.tp
        for s in reversed(range(plan.pp)):
            tps[plan.stages[s].dc] = plan.stage_tp(s)
        if tps == self.tps and plan.ep == self.ep:
            return self
        return PlanningContext(self.spec, self.profile, tps=tps, ep=plan.ep)

    # -- choices the job leaves open ---------------------------------------------------------
    def checkpointing_options(self) -> tuple[str, ...]:
        c = self.spec.job.checkpointing
        return CHECKPOINTING_ORDER if c == "auto" else (c,)

    def sharding_options(self) -> tuple[str, ...]:
        """The shardings to try; under tensor or expert parallelism not ZeRO-1, which the runtime
        refuses with tp > 1 or ep > 1 (runtime.train_config, layout.tp_check.ep_problem)."""
        s = self.spec.job.sharding
        opts = SHARDING_ORDER if s == "auto" else (s,)
        return tuple(x for x in opts if x != "zero1") if self.widest_tp > 1 or self.ep > 1 else opts

    def tp_of(self, dc_name: str) -> int:
        """The tensor-parallel degree of a stage in this DC."""
        return self.tps[dc_name]

    def tp_fits(self, dc_name: str) -> bool:
        """Does a TP group of the DC's tp stay inside one of its nodes (the runtime's rule)?"""
        return self.dc(dc_name).gpus_per_node % self.tps[dc_name] == 0

    def owns(self, dcs) -> bool:
        """Whether layouts over these DCs belong to this context: every kind of DC whose tp this
        context raises is among them (else a context with that kind at its smallest lists them;
        listing them here too would only repeat them)."""
        return all(any(n in dcs for n in names) for names in self._raised)

    def cost(self, checkpointing: str) -> CostModel:
        return self.costs.cost(checkpointing)

    # -- cluster -----------------------------------------------------------------------------
    def dc(self, name: str) -> Datacenter:
        return self.costs.dc(name)

    def gpu(self, dc_name: str) -> GPUType:
        return self._gpus[dc_name]

    def link(self, a: str, b: str) -> WanLink | None:
        """The link joining a and b (memoised: the search asks for the same pairs tens of thousands
        of times)."""
        return self.costs.link(a, b)

    # -- compute -----------------------------------------------------------------------------
    def table(self, gpu_type: str, micro_batch: int, checkpointing: str, tp: int | None = None) -> UnitTable:
        """Per-unit prefix sums on one GPU type at tensor-parallel degree `tp` (default: this
        context's smallest); `dc_table` for a DC at its own tp."""
        tp = self.tp if tp is None else tp
        key = (gpu_type, micro_batch, checkpointing, tp)
        t = self._tables.get(key)
        if t is None:
            st = [self.costs.compute([u], gpu_type, micro_batch, tp, checkpointing) for u in range(self.num_units)]
            t = UnitTable(
                forward=prefix_sums([x.forward for x in st]),
                backward=prefix_sums([x.backward for x in st]),
                backward_input=prefix_sums([x.backward_input for x in st]),
                backward_weight=prefix_sums([x.backward_weight for x in st]),
                step=prefix_sums([x.forward + x.backward for x in st]),
            )
            self._tables[key] = t
        return t

    def dc_table(self, dc_name: str, micro_batch: int, checkpointing: str) -> UnitTable:
        """`table` of the DC's GPU type at the DC's tp (memoised: the scorer asks per stage)."""
        key = (dc_name, micro_batch, checkpointing)
        t = self._dc_tables.get(key)
        if t is None:
            t = self._dc_tables[key] = self.table(self.dc(dc_name).gpu_type, micro_batch, checkpointing,
                                                  self.tps[dc_name])
        return t

    def shape(self, chunks: tuple[tuple[int, int], ...]) -> tuple[int, int, int]:
        """(has embedding, blocks, has head): all the cost model distinguishes between stages."""
        hit = self._shapes.get(chunks)
        if hit is None:
            hit = self._shapes[chunks] = self._shape(chunks)
        return hit

    def _shape(self, chunks: tuple[tuple[int, int], ...]) -> tuple[int, int, int]:
        last = self.num_units
        e = h = n = 0
        for a, b in chunks:
            e += a == 0
            h += b == last
            n += b - a
        return e, n - e - h, h

    def stage_fits(self, chunks: tuple[tuple[int, int], ...], dc_name: str, micro_batch: int, inflight,
                   sharding: str, dp: int, checkpointing: str) -> bool:
        """Does this stage's memory per GPU fit the DC's GPU? (memoised) `inflight`: micro-batches
        held, or an `estimate.Held` (held, of them between a split backward's B and W)."""
        inflight, deferred = (inflight[0], inflight[1]) if isinstance(inflight, tuple) else (inflight, 0.0)
        key = ("mem", self.shape(chunks), dc_name, micro_batch, round(inflight, 3), round(deferred, 3), sharding, dp,
               checkpointing)
        v = self._memo.get(key)
        if v is None:
            self.memory_calls += 1
            gpu = self.gpu(dc_name)
            units = _units(chunks)
            need = self.cost(checkpointing).stage_memory(
                units, gpu, micro_batch, max(1, ceil_inflight(inflight)), sharding, dp, self.tps[dc_name],
                deferred=deferred).total
            v = need / gpu.memory_bytes
            self._memo[key] = v
        return v <= 1.0

    def worst_stages(self, chunks, dcs, inflights) -> list[tuple[tuple, str, float]]:
        """(chunks, DC, in-flight) of the stages whose memory decides whether all fit: memory grows
        with the micro-batches in flight, so of the stages alike in shape and DC only the one
        holding the most counts (a pipeline of 80 stages has a handful of distinct ones)."""
        worst: dict[tuple, tuple[float, tuple]] = {}
        for ch, dc, k in zip(chunks, dcs, inflights, strict=True):
            key = (self.shape(ch), dc)
            w = worst.get(key)
            if w is None or k > w[0]:
                worst[key] = (k, ch)
        return [(ch, dc, k) for (_, dc), (k, ch) in worst.items()]

    def stage_memory_fraction(self, chunks, dc_name, micro_batch, inflight, sharding, dp, checkpointing) -> float:
        self.stage_fits(chunks, dc_name, micro_batch, inflight, sharding, dp, checkpointing)
        inflight, deferred = (inflight[0], inflight[1]) if isinstance(inflight, tuple) else (inflight, 0.0)
        key = ("mem", self.shape(chunks), dc_name, micro_batch, round(inflight, 3), round(deferred, 3), sharding, dp,
               checkpointing)
        return self._memo[key]

    def allreduce(self, chunks: tuple[tuple[int, int], ...], dp: int, dc_name: str, sharding: str,
                  microbatches: int) -> float:
        """A stage's DP sync inside its DC (comm.region_sync_time, with the simulator: zero3's m+1 gathers too)."""
        if dp <= 1:
            return 0.0
        key = ("ar", self.shape(chunks), len(chunks), dp, dc_name, sharding, _gathering(sharding, microbatches))
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self.costs.dp_sync([range(a, b) for a, b in chunks], [(dc_name, dp)], sharding,
                                                     microbatches, self.tps[dc_name])
        return v

    def allreduce_span(self, chunks: tuple[tuple[int, int], ...], span: tuple[str, ...], replicas: tuple[int, ...],
                       sharding: str, microbatches: int) -> float:
        """A region plan's DP sync: the stage's replicas spread over the DCs of `span` (one
        tp: region layouts span only DCs of one tp, regions.region_sets)."""
        key = ("ars", self.shape(chunks), len(chunks), span, replicas, sharding, _gathering(sharding, microbatches))
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self.costs.dp_sync([range(a, b) for a, b in chunks],
                                                     list(zip(span, replicas, strict=True)), sharding, microbatches,
                                                     self.tps[span[0]])
        return v

    def tied_sum(self, stage_dcs: tuple[str, ...], sharding: str, dp: int) -> float:
        """The tied embedding's gradient sum between a pipeline's first and last stage, per
        iteration (costs.comm.tied_sum_time; 0 for an untied model)."""
        chain = comm.pipeline_chain(stage_dcs)
        key = ("tied", tuple(chain), sharding, dp)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self.costs.tied_sum(stage_dcs, (self.tps[chain[0]], self.tps[chain[-1]]), sharding,
                                                      dp)
        return v

    def optimizer(self, chunks: tuple[tuple[int, int], ...], dc_name: str, sharding: str, dp: int) -> float:
        tp = self.tps[dc_name]
        key = ("opt", self.shape(chunks), self.dc(dc_name).gpu_type, sharding, dp, tp)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self.costs.optimizer(_units(chunks), dc_name, sharding, dp, tp)
        return v

    @lru_cache(maxsize=64)  # noqa: B019 -- one context per planning run
    def boundary_bytes(self, micro_batch: int) -> int:
        return self.costs.boundary_bytes(micro_batch)

    def tp_comm(self, chunks: tuple[tuple[int, int], ...], micro_batch: int, dc_name: str) -> float:
        """TP all-reduces of a stage per micro-batch (forward and backward) at its DC's tp."""
        tp = self.tps[dc_name]
        if tp <= 1 and self.ep <= 1:
            return 0.0
        key = ("tp", self.shape(chunks), micro_batch, dc_name)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self.costs.tp_comm(_units(chunks), micro_batch, tp, dc_name)
        return v

    def copies(self, a: str, b: str) -> int:
        """Copies of a boundary tensor between a stage in DC a and one in DC b: each receiving TP
        rank takes the whole (replicated) activation or input gradient from one sender, so the
        forward carries tp_b copies and the backward tp_a; the larger prices both directions."""
        ta, tb = self.tps[a], self.tps[b]
        return ta if ta > tb else tb

    def wan_copies(self, a: str, b: str) -> int:
        """Whole tensors' worth of bytes a boundary between DCs a and b moves (per direction): one
        where both run the same tp (scattered: tp flows of 1/tp each, Plan.boundary_copies), else
        `copies` (one whole copy per flow)."""
        return 1 if self.tps[a] == self.tps[b] else self.copies(a, b)

    def tp_gather(self, dc_name: str, nbytes: int) -> float:
        """The receiver's all-gather of a scattered boundary tensor in its TP group (inside the node)."""
        return self.costs.tp_gather(dc_name, nbytes, self.tps[dc_name])

    def intra_dc_transfer(self, dc_name: str, nbytes: int) -> float:
        return self.costs.intra_transfer(dc_name, nbytes)


def _units(chunks: tuple[tuple[int, int], ...]):
    """The units of a stage; a range when contiguous (the cost model counts those without a loop)."""
    if len(chunks) == 1:
        return range(chunks[0][0], chunks[0][1])
    return [u for a, b in chunks for u in range(a, b)]


def _gathering(sharding: str, microbatches: int) -> int:
    """What of the micro-batch count a sync's price depends on: zero3's gathers (a memo key part)."""
    return comm.fsdp_gathers(sharding, microbatches)


def ceil_inflight(x: float) -> int:
    i = int(x)
    return i if i >= x - 1e-9 else i + 1
