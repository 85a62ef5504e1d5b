"""Which datacenters a plan's ranks must reach: every pair of them.

torch.distributed connects every pair of ranks, whatever the plan sends where: the default process group's
gloo backend builds a full mesh of connections at start, and every rank talks to the rendezvous store on
rank 0's host. So a plan whose datacenters are not linked pairwise -- a 3-DC line (A-B-C, no A-C link),
pipeline stages in A, B and C -- cannot start: on the emulated WAN the rendezvous hangs, on real hosts it
waits out its timeout. The planner lists only chains of pairwise-linked DCs (`planner.placement.chains`),
and `reach_problem` refuses such a plan file in one line (validate, simulate, train, rehearse).
"""

from __future__ import annotations

from itertools import combinations


def unlinked_pair(cluster, dcs) -> tuple[str, str] | None:
    """The first pair of distinct DCs among `dcs` that no WAN link joins, or None."""
    for a, b in combinations(list(dict.fromkeys(dcs)), 2):
        if cluster.link(a, b) is None:
            return a, b
    return None


def reach_problem(plan, cluster) -> str | None:
    """One line if the plan puts ranks in two datacenters the cluster does not link, else None."""
    pair = unlinked_pair(cluster, plan.dcs_by_rank())
    if pair is None:
        return None
    a, b = pair
    return (f"plan {plan.name!r} puts ranks in {a} and {b}, which no WAN link joins: torch.distributed connects "
            "every pair of ranks (the process group's full mesh, the rendezvous store), so a plan's datacenters "
            f"must be linked pairwise -- add a [[wan_links]] between {a} and {b}, or plan on linked datacenters only")
