"""When the runtime posts each transfer of a lowered action list.

The runtime posts each receive alone, up to `RUNTIME_LOOKAHEAD` actions ahead of the RECV that
needs it (so the transfer lands while the rank computes), and each send alone at its SEND action.
On an in-order transport (NCCL: one stream per communicator, the k-th send of a pair meets the
k-th receive, tags ignored, a large send waits for its receive) that is safe only because the
runtime gives each direction of each neighbour pair its own process group
(`runtime.p2p.TorchTransport`): on one shared stream a receive posted ahead holds the
stream while the send its peer needs first queues behind it (`inorder.check_in_order(...,
streams="shared")` shows the circular wait, e.g. on tiny_2dc's 1F1B).

`lookahead=None` is the policy PyTorch's pipelining runtime uses for a shared stream: each maximal
run of consecutive SEND/RECV actions posted as one batch (`batch_isend_irecv`) at its first action.
It is kept for comparison: `check_in_order` shows it still deadlocks interleaved 1F1B on a shared
stream without PyTorch's lock-step time slots, which is why the runtime separates the directions.
"""

from __future__ import annotations

from collections.abc import Sequence

from geotrain.schedule.actions import Action, Op

RECVS = (Op.RECV_ACT, Op.RECV_GRAD)
SENDS = (Op.SEND_ACT, Op.SEND_GRAD)
RUNTIME_LOOKAHEAD = 2


def post_points(actions: Sequence[Action], lookahead: int | None = None) -> list[list[list[int]]]:
    """For each action index i, the batches (lists of action indices) to post right before action i runs.

    lookahead k >= 0: receives alone, up to k posted ahead; sends alone at their action (the runtime's).
    lookahead None: one batch per maximal run of consecutive transfer actions.
    Every transfer action appears in exactly one batch, posted at or before its own index."""
    n = len(actions)
    posts: list[list[list[int]]] = [[] for _ in range(n)]
    if lookahead is None:
        i = 0
        while i < n:
            if actions[i].op.is_comm:
                j = i
                while j < n and actions[j].op.is_comm:
                    j += 1
                posts[i].append(list(range(i, j)))
                i = j
            else:
                i += 1
        return posts
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    recv_idx = [i for i, a in enumerate(actions) if a.op in RECVS]
    nxt = 0
    for i, a in enumerate(actions):
        outstanding = sum(1 for j in recv_idx[:nxt] if j >= i)   # posted, not yet taken at its RECV
        while nxt < len(recv_idx) and (recv_idx[nxt] <= i or outstanding < lookahead):
            posts[i].append([recv_idx[nxt]])
            if recv_idx[nxt] >= i:
                outstanding += 1
            nxt += 1
        if a.op in SENDS:
            posts[i].append([i])
    return posts


__all__ = ["RECVS", "RUNTIME_LOOKAHEAD", "SENDS", "post_points"]
