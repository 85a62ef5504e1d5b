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

from geotrain.plan.plan import Plan
from geotrain.trace.schema import Event, Trace

US = 1e6
LINK_PID_OFFSET = 1000         # the links process sorts after every DC
LANE_TID_STRIDE = 1_000_000    # overlap lane k of rank r: tid = r + k * stride


def _lanes(events: list[Event]) -> list[int]:
    """Lane index of each event (same order as `events`) so that no two events of a lane overlap.
    Classic interval partitioning: sort by start, reuse the lane that frees earliest."""
    order = sorted(range(len(events)), key=lambda i: (events[i].start, events[i].end))
    free: list[tuple[float, int]] = []   # (end time, lane)
    n_lanes = 0
    lane = [0] * len(events)
    for i in order:
        e = events[i]
        if free and free[0][0] <= e.start:
            _, k = heapq.heappop(free)
        else:
            k = n_lanes
            n_lanes += 1
        lane[i] = k
        heapq.heappush(free, (e.end, k))
    # Stable and readable: lane 0 is the one the earliest event took.
    return lane


def _args(e: Event) -> dict[str, Any]:
    a: dict[str, Any] = {"stage": e.stage, "mb": e.mb, "iteration": e.iteration}
    if e.bytes:
        a["bytes"] = e.bytes
    if e.link:
        a["link"] = e.link
    if e.peer >= 0:
        a["peer"] = e.peer
    return a


def _name(e: Event) -> str:
    if e.kind == "transfer":
        return f"mb{e.mb} s{e.stage} r{e.rank}->r{e.peer}" if e.peer >= 0 else f"mb{e.mb} s{e.stage}"
    if e.mb >= 0:
        return f"{e.kind} mb{e.mb}"
    return e.kind


def _meta(ph_name: str, pid: int, tid: int | None, value: Any, key: str = "name") -> dict[str, Any]:
    ev: dict[str, Any] = {"ph": "M", "name": ph_name, "pid": pid, "args": {key: value}}
    if tid is not None:
        ev["tid"] = tid
    return ev


def to_chrome(trace: Trace, plan: Plan | None = None) -> dict[str, Any]:
    """The Chrome trace document as a dict ({"traceEvents": [...], ...})."""
    from geotrain.report.layout import dc_order, rank_layout

    layout = rank_layout(trace, plan)
    dcs = dc_order(layout)
    pid_of_dc = {dc: i + 1 for i, dc in enumerate(dcs)}
    out: list[dict[str, Any]] = []
    for dc, pid in pid_of_dc.items():
        out.append(_meta("process_name", pid, None, f"DC {dc}"))
        out.append(_meta("process_sort_index", pid, None, pid, "sort_index"))

    by_rank: dict[int, list[Event]] = {}
    by_link: dict[str, list[Event]] = {}
    for e in trace.events:
        if e.kind == "transfer":
            by_link.setdefault(e.link or "?", []).append(e)
        else:
            by_rank.setdefault(e.rank, []).append(e)

    named: set[tuple[int, int]] = set()
    for info in layout:
        pid = pid_of_dc[info.dc]
        named.add((pid, info.rank))
        name = f"rank {info.rank}" + (f" stage {info.stage}" if info.stage >= 0 else "") + (
            f" dp {info.replica}" if info.replica >= 0 else "")
        out.append(_meta("thread_name", pid, info.rank, name))
        out.append(_meta("thread_sort_index", pid, info.rank, info.rank, "sort_index"))
    for rank, evs in sorted(by_rank.items()):
        pid = pid_of_dc[layout[rank].dc]    # layout covers every rank that has events
        for e, k in zip(evs, _lanes(evs)):
            tid = rank + k * LANE_TID_STRIDE
            if (pid, tid) not in named:
                named.add((pid, tid))
                out.append(_meta("thread_name", pid, tid, f"rank {rank} (overlap {k})"))
                out.append(_meta("thread_sort_index", pid, tid, tid, "sort_index"))
            out.append({"ph": "X", "name": _name(e), "cat": e.kind, "pid": pid, "tid": tid,
                        "ts": e.start * US, "dur": max(0.0, e.end - e.start) * US, "args": _args(e)})

    if by_link:
        lpid = LINK_PID_OFFSET
        out.append(_meta("process_name", lpid, None, "WAN / links"))
        out.append(_meta("process_sort_index", lpid, None, lpid, "sort_index"))
        tid_base = 0
        for link, evs in sorted(by_link.items(), key=lambda kv: ("->" not in kv[0], kv[0])):
            lanes = _lanes(evs)
            for k in range(max(lanes) + 1):
                label = f"{link}" if k == 0 else f"{link} #{k + 1}"
                out.append(_meta("thread_name", lpid, tid_base + k, label))
                out.append(_meta("thread_sort_index", lpid, tid_base + k, tid_base + k, "sort_index"))
            for e, k in zip(evs, lanes):
                out.append({"ph": "X", "name": _name(e), "cat": "transfer", "pid": lpid, "tid": tid_base + k,
                            "ts": e.start * US, "dur": max(0.0, e.end - e.start) * US, "args": _args(e)})
            tid_base += max(lanes) + 1

    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"source": trace.source, "num_ranks": trace.num_ranks, "generator": "geotrain"}}


def write_chrome(trace: Trace, path: str | Path, plan: Plan | None = None) -> int:
    """Write the Chrome/Perfetto JSON; returns the number of "X" events written."""
    doc = to_chrome(trace, plan)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return sum(1 for ev in doc["traceEvents"] if ev["ph"] == "X")
