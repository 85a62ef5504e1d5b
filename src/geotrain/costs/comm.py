"""Collective-communication times inside one datacenter, and across the DCs of a region (alpha-beta
model of ring algorithms).

A ring reduce-scatter or all-gather of B bytes over n ranks moves (n-1)/n * B per rank in n-1
steps: t = (n-1)/n * B / bw + (n-1) * latency. An all-reduce is a reduce-scatter followed by an
all-gather: 2(n-1)/n * B / bw + 2(n-1) * latency.

When the group spans several nodes the collective is hierarchical (as NCCL's tree/ring mix and
HSDP do): a ring inside each node over NVLink-class `intra_node_gbps`, then a ring across nodes
over `intra_dc_gbps` on 1/g of the data (g ranks per node work on disjoint slices in parallel).
`intra_dc_gbps` is taken as the network bandwidth of one GPU (one NIC per GPU, as in DGX-class
nodes). The spec has a single latency, `intra_dc_latency_us`, used for every step: conservative
for NVLink hops, which is fine for the small latency-bound collectives it matters for.
"""

from __future__ import annotations

from geotrain.spec.cluster import Datacenter

GBIT = 1e9 / 8  # bytes/s per Gbit/s


def ring_half(nbytes: float, n: int, bw_bytes_s: float, latency_s: float) -> float:
    """One ring reduce-scatter or all-gather of `nbytes` over `n` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / bw_bytes_s + (n - 1) * latency_s


def hierarchical_half(nbytes: float, n: int, per_node: int, dc: Datacenter) -> float:
    """A reduce-scatter (or all-gather) over `n` ranks packed `per_node` to a node."""
    lat = dc.intra_dc_latency_us * 1e-6
    g = max(1, min(n, per_node))
    if n <= g:
        return ring_half(nbytes, n, dc.intra_node_gbps * GBIT, lat)
    nodes = -(-n // g)
    return (ring_half(nbytes, g, dc.intra_node_gbps * GBIT, lat)
            + ring_half(nbytes / g, nodes, dc.intra_dc_gbps * GBIT, lat))


SYNC_SHARDINGS = ("replicate", "zero1", "zero2", "zero3")
BACKENDS = ("nccl", "gloo")


def fsdp_gathers(sharding: str, microbatches: int) -> int:
    """Parameter all-gathers FSDP2 runs for one pipeline chunk per iteration, as
    runtime/parallelize.py configures it. zero2 (reshard_after_forward=False): once, at the first
    forward, kept until the reduce-scatter reshards. zero3 (reshard_after_forward=True, the
    micro-batch backwards with reshard_after_backward off): every forward reshards after itself
    and only a forward does, so an op gathers when it is the chunk's first of the iteration or
    follows a forward -- 1 + (forwards not last) = microbatches + 1 in every schedule whose chunk
    ends its iteration with a backward (all of them: tests/test_dp_sync.py reads it off each
    kind's actions). replicate/zero1 gather nothing (their all-reduce is in `sync_collectives`)."""
    if sharding == "fsdp":
        sharding = "zero3"
    if sharding == "zero3":
        return microbatches + 1
    return 1 if sharding == "zero2" else 0


def sync_collectives(sharding: str, chunks: list[tuple[float, float]], microbatches: int,
                     backend: str = "nccl") -> list[tuple[str, float]]:
    """(kind, bytes) of every reduce-scatter and all-gather one DP group runs per iteration for a
    stage: the one definition the sync's time (dp_sync_time, cross_dc_sync_time) and its WAN
    bytes (layout.wan_bytes) count. chunks: per pipeline chunk, (gradient bytes, gathered
    parameter bytes) -- CostModel.sync_collectives. replicate: one all-reduce of the stage's
    gradients (a reduce-scatter and an all-gather); zero1 that, then ZeroRedundancyOptimizer's
    broadcast of each rank's updated partition to the others -- on the wire an all-gather of the
    parameters (in their own dtype: fp32 master weights); zero2/zero3: per chunk FSDP2's
    reduce-scatter of its gradients and `fsdp_gathers` gathers of its parameters. backend
    "gloo" (a CPU run's ranks): gloo's reduce_scatter_tensor is an all-reduce on the wire (1.00x
    the tensor each way between two ranks, measured on loopback, where a ring reduce-scatter and
    all_gather_into_tensor send 0.50x), so its reduce-scatter counts twice."""
    if sharding == "fsdp":
        sharding = "zero3"
    if sharding not in SYNC_SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r} (known: {', '.join(SYNC_SHARDINGS)})")
    if backend not in BACKENDS:
        raise ValueError(f"unknown collective backend {backend!r} (known: {', '.join(BACKENDS)})")
    if sharding in ("replicate", "zero1"):
        g = sum(grad for grad, _ in chunks)
        broadcast = [("all-gather", sum(p for _, p in chunks))] if sharding == "zero1" else []
        return [("reduce-scatter", g), ("all-gather", g), *broadcast]
    out: list[tuple[str, float]] = []
    gathers = fsdp_gathers(sharding, microbatches)
    for grad, params in chunks:
        out += [("reduce-scatter", grad)] * (2 if backend == "gloo" else 1)
        out += [("all-gather", params)] * gathers
    return out


def dp_sync_time(collectives: list[tuple[str, float]], dp: int, dc: Datacenter, tp: int = 1) -> float:
    """A stage's DP sync per iteration inside one DC: each of its `sync_collectives` (bytes per
    GPU: one tp slice) as a hierarchical ring half over the dp replicas, one after another."""
    if dp <= 1:
        return 0.0
    # A replica of a stage occupies tp consecutive GPUs, so gpus_per_node // tp replicas share a node.
    per_node = max(1, dc.gpus_per_node // tp)
    return sum(count * hierarchical_half(nbytes, dp, per_node, dc) for nbytes, count in _counted(collectives))


def _counted(collectives: list[tuple[str, float]]) -> list[tuple[float, int]]:
    """(bytes, how many) of a sync's collectives: a zero3 stage runs m+1 gathers of one size."""
    counts: dict[float, int] = {}
    for _, nbytes in collectives:
        counts[nbytes] = counts.get(nbytes, 0) + 1
    return list(counts.items())


def allreduce_time(nbytes: float, n: int, per_node: int, dc: Datacenter) -> float:
    return 2 * hierarchical_half(nbytes, n, per_node, dc)


def cross_dc_sync_time(collectives: list[tuple[str, float]], groups: list[tuple[Datacenter, int]], links: list,
                       tp: int = 1) -> float:
    """DP sync of a stage whose replicas span DCs (a region plan), per iteration.

    Hierarchical, per reduce-scatter/all-gather half (`sync_collectives`, bytes per GPU: one tp
    slice): inside each DC a half over its replicas (hierarchical_half: NVLink ring, then across
    nodes), then a ring across the k DCs over the WAN on each replica's shard -- every replica
    (all its tp ranks) owns a slice and sends it on its own connection, so a link carries
    (k-1)/k of the stage's whole tensor (all tp slices) at min(capacity, owners x per-connection
    rate), owners = tp x the fewest replicas in a DC, in k-1 steps of the slowest link's latency.
    The slowest of `links` (every pair of the DCs) prices the ring."""
    groups = [(dc, n) for dc, n in groups if n > 0]
    if len(groups) == 1:
        dc, n = groups[0]
        return dp_sync_time(collectives, n, dc, tp)
    k = len(groups)
    owners = min(n for _, n in groups) * tp
    rate = min(link.rate_gbps(owners) for link in links) * GBIT
    lat = max(link.latency_ms for link in links) * 1e-3
    total = 0.0
    for nbytes, count in _counted(collectives):
        intra = max(hierarchical_half(nbytes, n, max(1, dc.gpus_per_node // tp), dc) for dc, n in groups)
        total += count * (intra + (k - 1) / k * nbytes * tp / rate + (k - 1) * lat)
    return total


def region_sync_time(collectives: list[tuple[str, float]], spread: list[tuple[str, int]], dc, link,
                     tp: int = 1) -> float:
    """A stage's DP sync over the DCs its replicas sit in: `spread` (DC name, replicas) in ring
    order -- one DC for an ordinary plan --, `dc(name)`, `link(a, b)` the cluster's (or a
    planner's memoised) lookups: inside one DC dp_sync_time, across several cross_dc_sync_time
    over every pair's link. The simulator (sim.simulate) and the planner's context
    (PlanningContext.allreduce, allreduce_span) both price a stage's sync here."""
    names = [d for d, _ in spread]
    links = [link(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    return cross_dc_sync_time(collectives, [(dc(d), n) for d, n in spread], links, tp)


def pipeline_chain(stage_dcs) -> list[str]:
    """A pipeline's DCs in order, each once per contiguous run of its stages."""
    chain: list[str] = []
    for dc in stage_dcs:
        if not chain or chain[-1] != dc:
            chain.append(dc)
    return chain


def tied_route(link, chain: list[str]) -> list:
    """The WAN links a pipeline's first and last DC talk over: the direct link when there is one,
    else the pipeline's own links in turn; [] when both ends share a DC. `link(a, b)`: the
    cluster's link lookup."""
    if len(chain) < 2 or chain[0] == chain[-1]:
        return []
    direct = link(chain[0], chain[-1])
    return [direct] if direct is not None else [link(a, b) for a, b in zip(chain, chain[1:])]


def pipeline_tied_sum_time(nbytes: float, pairs: int, stage_dcs, dc, link) -> float:
    """`tied_sum_time` for a pipeline whose stages sit in `stage_dcs`, between its first and last
    DC over their route (`dc(name)`, `link(a, b)`: the cluster's lookups); 0 for one stage or
    nothing to sum. The simulator and the planner's estimate both price the sum here."""
    stage_dcs = list(stage_dcs)
    if nbytes <= 0 or len(stage_dcs) < 2:
        return 0.0
    chain = pipeline_chain(stage_dcs)
    return tied_sum_time(nbytes, pairs, dc(chain[0]), tied_route(link, chain))


def tied_sum_time(nbytes: float, pairs: int, first: Datacenter, route: list) -> float:
    """The tied embedding's gradient sum per iteration (`runtime.tied`): `pairs` two-rank
    all-reduces of `nbytes` each (one per DP replica and TP index, first stage with last), all at
    once, by the process group's plain all-reduce -- one connection a pair, not the striped WAN
    transport. A two-rank ring sends nbytes each way in two steps, so across DCs the pairs share
    the route's slowest link at min(capacity, pairs x per-connection rate) and pay its latency
    twice; inside one DC (`route` empty) it is a ring of two over the intra-DC network."""
    if nbytes <= 0 or pairs <= 0:
        return 0.0
    if not route:
        return 2 * ring_half(nbytes, 2, first.intra_dc_gbps * GBIT, first.intra_dc_latency_us * 1e-6)
    rate = min(link.rate_gbps(pairs) for link in route) * GBIT
    return pairs * nbytes / rate + 2 * sum(link.latency_ms for link in route) * 1e-3
