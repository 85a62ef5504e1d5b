"""Export a Trace as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and
chrome://tracing open directly.

Layout: one process per DC, one thread per rank (named "rank R stage S dp D"), and one extra
process "WAN / links" with a track per link. Everything is an "X" (complete) event with times in
microseconds. Chrome requires the slices of one thread to nest; concurrent transfers on a link
(fair sharing) or overlapping events of one rank would not, so they are spread over extra lanes
("A->B #2") -- lanes are assigned greedily, which uses the fewest lanes possible.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Any

import numpy as np

from geotrain.layout.plan import Plan
from geotrain.trace.metrics import trace_columns
from geotrain.trace.rank_roles import dc_order, rank_layout
from geotrain.trace.schema import Trace

US = 1e6
LINK_PID_OFFSET = 1000         # the links process sorts after every DC
LANE_TID_STRIDE = 1_000_000    # overlap lane k of rank r: tid = r + k * stride


def _lanes(start: np.ndarray, end: np.ndarray) -> list[int]:
    """Lane of each interval (given sorted by start) so that no two intervals of a lane overlap.
    The common case -- no overlap at all -- is checked with numpy; otherwise classic interval
    partitioning: reuse the lane that frees earliest (the fewest lanes possible)."""
    n = len(start)
    if n <= 1 or bool(np.all(start[1:] >= np.maximum.accumulate(end)[:-1])):
        return [0] * n
    free: list[tuple[float, int]] = []   # (end time, lane) of every lane
    lanes = []
    for a, b in zip(start.tolist(), end.tolist()):
        if free and free[0][0] <= a:
            _, k = heapq.heappop(free)
        else:
            k = len(free)                # every lane is busy: open a new one
        lanes.append(k)
        heapq.heappush(free, (b, k))
    return lanes


class _Cols:
    """Plain-list view of the trace columns (list indexing is much faster than numpy scalars)."""

    def __init__(self, trace: Trace):
        c = trace_columns(trace)
        self.arrays = c
        self.rank, self.stage, self.mb = c.rank.tolist(), c.stage.tolist(), c.mb.tolist()
        self.it, self.peer, self.bytes = c.iteration.tolist(), c.peer.tolist(), c.bytes.tolist()
        self.start, self.end = c.start.tolist(), c.end.tolist()
        self.kind = [c.kind_names[k] for k in c.kind.tolist()]
        self.link = [c.link_names[k] if k >= 0 else "" for k in c.link.tolist()]

    def x_event(self, i: int, pid: int, tid: int) -> dict[str, Any]:
        kind, mb = self.kind[i], self.mb[i]
        args: dict[str, Any] = {"stage": self.stage[i], "mb": mb, "iteration": self.it[i]}
        if self.bytes[i]:
            args["bytes"] = self.bytes[i]
        if self.link[i]:
            args["link"] = self.link[i]
        if self.peer[i] >= 0:
            args["peer"] = self.peer[i]
        if kind == "transfer":
            name = f"mb{mb} s{self.stage[i]} r{self.rank[i]}->r{self.peer[i]}"
        else:
            name = f"{kind} mb{mb}" if mb >= 0 else kind
        return {"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": tid, "ts": self.start[i] * US,
                "dur": max(0.0, self.end[i] - self.start[i]) * US, "args": args}


def _groups(keys: np.ndarray, start: np.ndarray, end: np.ndarray, idx: np.ndarray) -> list[np.ndarray]:
    """Indices `idx` grouped by key, each group sorted by (start, end)."""
    if len(idx) == 0:
        return []
    order = idx[np.lexsort((end[idx], start[idx], keys[idx]))]
    k = keys[order]
    cuts = np.flatnonzero(k[1:] != k[:-1]) + 1
    return np.split(order, cuts)


def _meta(ph_name: str, pid: int, tid: int | None, value: Any, key: str = "name") -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "M", "name": ph_name, "pid": pid, "args": {key: value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def to_chrome(trace: Trace, plan: Plan | None = None) -> dict[str, Any]:
    """The Chrome trace document as a dict ({"traceEvents": [...], ...})."""
    layout = rank_layout(trace, plan)
    dcs = dc_order(layout)
    pid_of_dc = {dc: i + 1 for i, dc in enumerate(dcs)}
    out: list[dict[str, Any]] = []
    for dc, pid in pid_of_dc.items():
        out.append(_meta("process_name", pid, None, f"DC {dc}"))
        out.append(_meta("process_sort_index", pid, None, pid, "sort_index"))

    cols = _Cols(trace)
    c = cols.arrays
    is_xfer = c.kind_mask({"transfer"})

    named: set[tuple[int, int]] = set()
    for info in layout:
        pid = pid_of_dc[info.dc]
        named.add((pid, info.rank))
        name = f"rank {info.rank}" + (f" stage {info.stage}" if info.stage >= 0 else "") + (
            f" dp {info.replica}" if info.replica >= 0 else "")
        out.append(_meta("thread_name", pid, info.rank, name))
        out.append(_meta("thread_sort_index", pid, info.rank, info.rank, "sort_index"))
    for g in _groups(c.rank, c.start, c.end, np.flatnonzero(~is_xfer)):
        rank = cols.rank[int(g[0])]
        pid = pid_of_dc[layout[rank].dc]    # layout covers every rank that has events
        for i, k in zip(g.tolist(), _lanes(c.start[g], c.end[g])):
            tid = rank + k * LANE_TID_STRIDE
            if (pid, tid) not in named:
                named.add((pid, tid))
                out.append(_meta("thread_name", pid, tid, f"rank {rank} (overlap {k})"))
                out.append(_meta("thread_sort_index", pid, tid, tid, "sort_index"))
            out.append(cols.x_event(i, pid, tid))

    link_groups = _groups(c.link, c.start, c.end, np.flatnonzero(is_xfer))
    if link_groups:
        lpid = LINK_PID_OFFSET
        out.append(_meta("process_name", lpid, None, "WAN / links"))
        out.append(_meta("process_sort_index", lpid, None, lpid, "sort_index"))
        tid_base = 0
        for g in sorted(link_groups, key=lambda g: ("->" not in cols.link[int(g[0])], cols.link[int(g[0])])):
            link = cols.link[int(g[0])] or "?"
            lanes = _lanes(c.start[g], c.end[g])
            for k in range(max(lanes) + 1):
                label = f"{link}" if k == 0 else f"{link} #{k + 1}"
                out.append(_meta("thread_name", lpid, tid_base + k, label))
                out.append(_meta("thread_sort_index", lpid, tid_base + k, tid_base + k, "sort_index"))
            for i, k in zip(g.tolist(), lanes):
                out.append(cols.x_event(i, lpid, tid_base + k))
            tid_base += max(lanes) + 1

    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": trace.source, "num_ranks": trace.num_ranks, "generator": "geotrain"}}


def write_chrome(trace: Trace, path: str | Path, plan: Plan | None = None) -> int:
    """Write the Chrome/Perfetto JSON; returns the number of "X" events written."""
    doc = to_chrome(trace, plan)
    with open(path, "w") as f:
        f.write(json.dumps(doc, separators=(",", ":")))
    return sum(1 for ev in doc["traceEvents"] if ev["ph"] == "X")
