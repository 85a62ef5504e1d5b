"""Placement choices: which DCs form the pipeline, in which order, and how many stages each hosts.

A pipeline is a chain of DCs in which consecutive DCs are joined by a WAN link (the WAN graph
need not be complete), each DC hosting one or more *consecutive* stages. Every stage has the
same data-parallel degree dp (its dp replicas, times tp, sit in the stage's DC), so a DC with
G GPUs can host at most G // (dp * tp) stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache

from geotrain.spec.cluster import Cluster

MAX_CHAINS = 4000


def chains(cluster: Cluster, limit: int = MAX_CHAINS) -> list[tuple[str, ...]]:
    """Every simple path in the WAN graph (single DCs included) whose DCs are linked pairwise, up to
    `limit` paths: torch.distributed connects every pair of ranks, so a path through a DC that does
    not link its ends (a 3-DC line) could never start (layout.reach).

    Order matters (the first stage holds the embedding and the most in-flight activations;
    the links used differ), so a path and its reverse are both listed."""
    names = [dc.name for dc in cluster.datacenters]
    adj = {n: [m for m in names if m != n and cluster.link(n, m) is not None] for n in names}
    out: list[tuple[str, ...]] = []

    def walk(path: list[str]) -> None:
        if len(out) >= limit:
            return
        out.append(tuple(path))
        for nxt in adj[path[-1]]:
            if nxt not in path and all(nxt in adj[p] for p in path):
                path.append(nxt)
                walk(path)
                path.pop()

    for n in names:
        walk([n])
    return out


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@lru_cache(maxsize=4096)
def pp_candidates(lo: int, hi: int, dense_up_to: int = 12) -> tuple[int, ...]:
    """Pipeline depths to try between lo and hi: every value near the bottom, then a geometric
    ladder (x1.25) -- the estimate is smooth in pp, so the gaps cost little."""
    if hi < lo:
        return []
    vals = set(range(lo, min(hi, lo + dense_up_to) + 1))
    x = float(max(lo, 1))
    while x < hi:
        vals.add(int(round(x)))
        x *= 1.25
    vals.add(hi)
    return tuple(sorted(v for v in vals if lo <= v <= hi))


def distribute_stages(pp: int, caps: Sequence[int], speeds: Sequence[float]) -> tuple[int, ...] | None:
    """Stages per DC along a chain: at least one each, at most caps[i]; the rest go where a stage
    adds the most throughput (fastest GPUs first, then the DC with the most room left), since the
    balanced split later gives each stage work in proportion to its speed.

    Only the speeds' order and ties matter, so the answer is memoised on their ranks: the search
    asks the same question for every micro-batch size and for chains that share a DC sequence."""
    return distribute_ranked(pp, tuple(caps), speed_ranks(speeds))


def speed_ranks(speeds: Sequence[float], memory: Sequence[float] | None = None) -> tuple[tuple[int, int], ...]:
    """Per DC (speed rank, memory rank): 0 for the fastest GPU type, 1 for the next, equal speeds
    sharing a rank; then 0 for the most memory per GPU. Among equally fast DCs the one with more
    memory takes a left-over stage first: the early stages hold the most activations, and a
    40 GB DC taking the extra stage is what made a layout not fit."""
    order = sorted(set(speeds), reverse=True)
    mem = list(memory) if memory is not None else [0.0] * len(speeds)
    morder = sorted(set(mem), reverse=True)
    return tuple((order.index(x), morder.index(g)) for x, g in zip(speeds, mem, strict=True))


@lru_cache(maxsize=1 << 16)
def distribute_ranked(pp: int, caps: tuple[int, ...], ranks: tuple[tuple[int, int], ...]) -> tuple[int, ...] | None:
    n = len(caps)
    if pp < n or pp > sum(caps) or min(caps) < 1:
        return None
    counts = [1] * n
    left = pp - n
    order = sorted(range(n), key=lambda i: (ranks[i], -caps[i]))
    # Fill the fastest GPU type first; within equally fast DCs, proportionally to their room.
    i = 0
    while left > 0 and i < n:
        speed = ranks[order[i]][0]
        group = [j for j in order if ranks[j][0] == speed]
        room = {j: caps[j] - counts[j] for j in group}
        total_room = sum(room.values())
        if total_room > 0:
            take = min(left, total_room)
            shares = {j: take * room[j] // total_room for j in group}
            rest = take - sum(shares.values())
            for j in sorted(group, key=lambda j: (-(room[j] - shares[j]), ranks[j][1])):
                if rest <= 0:
                    break
                if shares[j] < room[j]:
                    shares[j] += 1
                    rest -= 1
            for j in group:
                counts[j] += shares[j]
            left -= take
        i += len(group)
    return tuple(counts) if left == 0 else None


def stage_dcs(chain: Sequence[str], counts: Sequence[int]) -> list[str]:
    return [dc for dc, c in zip(chain, counts, strict=True) for _ in range(c)]


def iter_dp(global_batch: int, micro_batch: int, max_dp: int) -> Iterator[int]:
    for d in divisors(global_batch // micro_batch):
        if d <= max_dp:
            yield d
