"""Metrics of a trace: iteration time, throughput, busy fractions, bubbles, link use, WAN bytes.

The same code serves predicted (simulator) and measured (runtime) traces, so a prediction and a
measurement are judged by one yardstick. It works on column arrays (numpy), not on `Event`
objects: a simulated trace of a thousand GPUs holds hundreds of thousands of events, and a trace
that can hand over its columns directly (`trace.columns()`, as the simulator's does) never has to
build them.

Definitions (all per iteration, averaged over the iterations in the trace):
  * iteration window i: from the earliest start of a training compute event of iteration i to
    the last end of an optimizer event of iteration i (any event, where there is none of these
    kinds). Compute, not any event: with several iterations, a stage that finished iteration i
    early is already blocked on a receive of iteration i+1, which does not start iteration i+1;
  * iteration_time: mean window length; tokens_per_s = tokens_per_iteration / iteration_time;
  * busy_fraction[rank]: training compute time (forward, backward, backward_input,
    backward_weight, optimizer -- not allreduce, not waiting, not prefill) / iteration time;
  * bubbles: per rank and window, the gaps without training compute (leading, between and
    trailing), as (rank, start, end);
  * link_utilization: for a link whose capacity the trace's meta gives (WAN directions from the
    simulator: meta["links"][name]["capacity_Bps"]): bytes carried / (capacity x span); for other
    links (intra-DC, or a measured trace without capacities): the fraction of the span with at
    least one transfer in flight. span = first window start to last window end;
  * wan_bytes: bytes of transfers on WAN links (names "A->B") per iteration, plus the bytes
    the trace's meta gives for collectives that cross DCs without transfer events of their own
    (meta[WAN_COLLECTIVE_BYTES], per iteration: a simulated region plan's DP sync, the tied
    embedding sum -- layout.wan_bytes, the definition the egress price uses too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from geotrain.trace.schema import TRAINING_COMPUTE_KINDS, Event, Trace

# The kinds in a fixed order; the simulator codes its events with these indices.
KINDS: tuple[str, ...] = ("forward", "backward", "backward_input", "backward_weight", "optimizer", "prefill",
                          "allreduce", "recv_wait", "transfer")
KIND_CODE: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
WAN_COLLECTIVE_BYTES = "wan_collective_bytes_per_iteration"   # trace meta key, see wan_bytes above
MACHINE_LOAD_NAME = "machine_load.json"   # RUN_DIR file: what else the machine ran during `geotrain train`
LINK_COUNTERS_NAME = "wan_bytes.json"   # RUN_DIR file: per DC, bytes the emulated WAN links counted, whole run


@dataclass
class Columns:
    """A trace as parallel arrays, one entry per event. kind and link are codes into
    `kind_names` and `link_names` (link -1: no link)."""

    rank: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    iteration: np.ndarray
    peer: np.ndarray
    bytes: np.ndarray
    link: np.ndarray
    start: np.ndarray
    end: np.ndarray
    kind_names: tuple[str, ...] = KINDS
    link_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.rank)

    def kind_mask(self, kinds: set[str] | frozenset[str]) -> np.ndarray:
        codes = [i for i, k in enumerate(self.kind_names) if k in kinds]
        return np.isin(self.kind, codes)

    def select(self, mask: np.ndarray) -> Columns:
        """The events where `mask` holds (same name tables), e.g. to build Events for a few ranks
        of a big trace without building all of them."""
        arrays = {f: getattr(self, f)[mask] for f in ("rank", "kind", "stage", "mb", "iteration", "peer", "bytes",
                                                        "link", "start", "end")}
        return Columns(**arrays, kind_names=self.kind_names, link_names=self.link_names)

    def to_events(self) -> list[Event]:
        kn, ln = self.kind_names, self.link_names
        links = [ln[i] if i >= 0 else "" for i in self.link.tolist()]
        return [
            Event(rank=r, kind=kn[k], start=s, end=e, stage=st, mb=mb, bytes=b, link=lk, iteration=it, peer=p)
            for r, k, s, e, st, mb, b, lk, it, p in zip(
                self.rank.tolist(), self.kind.tolist(), self.start.tolist(), self.end.tolist(),
                self.stage.tolist(), self.mb.tolist(), self.bytes.tolist(), links,
                self.iteration.tolist(), self.peer.tolist())
        ]


def columns_from_events(events: list[Event]) -> Columns:
    kinds = list(KINDS)
    kcode = dict(KIND_CODE)
    links: list[str] = []
    lcode: dict[str, int] = {}
    kc, lc = [], []
    for e in events:
        if e.kind not in kcode:
            kcode[e.kind] = len(kinds)
            kinds.append(e.kind)
        kc.append(kcode[e.kind])
        if e.link:
            if e.link not in lcode:
                lcode[e.link] = len(links)
                links.append(e.link)
            lc.append(lcode[e.link])
        else:
            lc.append(-1)

    def ints(attr: str) -> np.ndarray:
        return np.array([getattr(e, attr) for e in events], dtype=np.int64)

    return Columns(
        rank=ints("rank"), kind=np.array(kc, dtype=np.int64), stage=ints("stage"), mb=ints("mb"),
        iteration=ints("iteration"), peer=ints("peer"), bytes=ints("bytes"), link=np.array(lc, dtype=np.int64),
        start=np.array([e.start for e in events], dtype=float), end=np.array([e.end for e in events], dtype=float),
        kind_names=tuple(kinds), link_names=tuple(links),
    )


def trace_columns(trace: Trace) -> Columns:
    """The trace's columns: its own when it keeps them (simulator), else built from its events."""
    own = getattr(trace, "columns", None)
    if callable(own):
        return own()
    return columns_from_events(trace.events)


@dataclass
class Metrics:
    iteration_time: float
    tokens_per_s: float
    busy_fraction: dict[int, float]            # per rank, training compute time / iteration time
    mean_utilization: float
    bubbles: list[tuple[int, float, float]]    # (rank, start, end): intervals with no training compute
    link_utilization: dict[str, float]         # link name -> busy fraction (see module docstring)
    wan_bytes: int                             # bytes over WAN links per iteration
    peak_memory: dict[int, float] = field(default_factory=dict)  # per rank, bytes (from the cost model)
    iterations: int = 1
    bubble_fraction: float = 0.0               # total bubble time / (ranks x iterations x iteration time)

    def summary(self) -> dict[str, Any]:
        """The scalar metrics, for reports and JSON."""
        return {
            "iteration_time_s": self.iteration_time, "tokens_per_s": self.tokens_per_s,
            "mean_utilization": self.mean_utilization, "bubble_fraction": self.bubble_fraction,
            "num_bubbles": len(self.bubbles), "wan_bytes_per_iteration": self.wan_bytes,
            "link_utilization": dict(self.link_utilization),
            "peak_memory_max_bytes": max(self.peak_memory.values()) if self.peak_memory else None,
            "iterations": self.iterations,
        }


def iteration_windows(cols: Columns) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(iteration ids, window starts, window ends), see the module docstring."""
    its = np.unique(cols.iteration)
    opt = cols.kind_mask({"optimizer"})
    comp = cols.kind_mask(TRAINING_COMPUTE_KINDS)
    w0 = np.empty(len(its))
    w1 = np.empty(len(its))
    for i, it in enumerate(its):
        m = cols.iteration == it
        mc = m & comp
        w0[i] = cols.start[mc].min() if mc.any() else cols.start[m].min()
        mo = m & opt
        w1[i] = cols.end[mo].max() if mo.any() else cols.end[m].max()
    return its, w0, w1


def _bubbles(cols: Columns, num_ranks: int, its: np.ndarray, w0: np.ndarray, w1: np.ndarray,
             eps: float) -> list[tuple[int, float, float]]:
    comp = cols.kind_mask(TRAINING_COMPUTE_KINDS)
    rank, it, start, end = cols.rank[comp], cols.iteration[comp], cols.start[comp], cols.end[comp]
    it_idx = np.searchsorted(its, it)
    n_it = len(its)
    key = rank * n_it + it_idx
    order = np.lexsort((start, key))
    key, start, end, it_idx = key[order], start[order], end[order], it_idx[order]
    # Gaps between consecutive compute events of the same (rank, iteration) group.
    same = key[1:] == key[:-1]
    g_r, g_s, g_e = key[1:][same] // n_it, end[:-1][same], start[1:][same]
    # Leading and trailing gaps of each group, against its iteration window.
    first = np.ones(len(key), dtype=bool)
    first[1:] = ~same
    last = np.ones(len(key), dtype=bool)
    last[:-1] = ~same
    lead_r, lead_s, lead_e = key[first] // n_it, w0[it_idx[first]], start[first]
    tail_r, tail_s, tail_e = key[last] // n_it, end[last], w1[it_idx[last]]
    # (rank, iteration) groups with no compute at all: the whole window is a bubble.
    have = np.zeros(num_ranks * n_it, dtype=bool)
    have[key] = True
    empty = np.flatnonzero(~have)
    e_r, e_s, e_e = empty // n_it, w0[empty % n_it], w1[empty % n_it]
    r = np.concatenate([g_r, lead_r, tail_r, e_r])
    s = np.concatenate([g_s, lead_s, tail_s, e_s])
    e = np.concatenate([g_e, lead_e, tail_e, e_e])
    keep = (e - s) > eps
    r, s, e = r[keep], s[keep], e[keep]
    order = np.lexsort((s, r))
    return list(zip(r[order].tolist(), s[order].tolist(), e[order].tolist()))


def _union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total length of the union of intervals [start, end)."""
    if len(start) == 0:
        return 0.0
    o = np.argsort(start, kind="stable")
    s, e = start[o], end[o]
    reach = np.maximum.accumulate(e)
    gaps = s[1:] - reach[:-1]
    return float(reach[-1] - s[0] - gaps[gaps > 0].sum())


def compute_ratio(predicted: Trace, measured: Trace, kinds=TRAINING_COMPUTE_KINDS) -> float | None:
    """Compute per iteration (the `kinds` events' time, all ranks) measured over predicted, or None
    when either trace has none: whether an error is compute that ran at another speed than the
    profile measured rather than the network or the schedule (the report's notes, the validation
    table's column, and the core pool's residual -- forward and backward kinds -- in the profile)."""
    def per_iteration(trace: Trace) -> float:
        its = {e.iteration for e in trace.events}
        busy = sum(e.end - e.start for e in trace.events if e.kind in kinds)
        return busy / len(its) if its else 0.0

    p, m = per_iteration(predicted), per_iteration(measured)
    return m / p if p > 0 and m > 0 else None


def compute_metrics(trace: Trace, tokens_per_iteration: int, peak_memory: dict[int, float] | None = None) -> Metrics:
    cols = trace_columns(trace)
    num_ranks = max(trace.num_ranks, int(cols.rank.max()) + 1 if len(cols) else 0)
    if len(cols) == 0:
        raise ValueError("cannot compute metrics of an empty trace")
    its, w0, w1 = iteration_windows(cols)
    n_it = len(its)
    iteration_time = float(np.mean(w1 - w0))
    span = float(w1.max() - w0.min())
    eps = 1e-9 * max(iteration_time, 1e-12)

    comp = cols.kind_mask(TRAINING_COMPUTE_KINDS)
    busy_time = np.bincount(cols.rank[comp], weights=(cols.end - cols.start)[comp], minlength=num_ranks)
    denom = n_it * iteration_time if iteration_time > 0 else 1.0
    busy = {r: float(b) / denom for r, b in enumerate(busy_time.tolist())}
    bubbles = _bubbles(cols, num_ranks, its, w0, w1, eps)
    bubble_time = sum(e - s for _, s, e in bubbles)

    link_caps = {name: info.get("capacity_Bps") for name, info in trace.meta.get("links", {}).items()}
    xfer = cols.kind_mask({"transfer"}) & (cols.link >= 0)
    link_util: dict[str, float] = {}
    wan_bytes = 0
    for li, name in enumerate(cols.link_names):
        m = xfer & (cols.link == li)
        if not m.any():
            continue
        nbytes = int(cols.bytes[m].sum())
        if "->" in name:
            wan_bytes += nbytes
        cap = link_caps.get(name)
        if cap and span > 0:
            link_util[name] = nbytes / (cap * span)
        else:
            link_util[name] = _union_length(cols.start[m], cols.end[m]) / span if span > 0 else 0.0

    return Metrics(
        iteration_time=iteration_time,
        tokens_per_s=tokens_per_iteration / iteration_time if iteration_time > 0 else float("inf"),
        busy_fraction=busy,
        mean_utilization=float(np.mean(list(busy.values()))) if busy else 0.0,
        bubbles=bubbles,
        link_utilization=link_util,
        wan_bytes=wan_bytes // n_it + int(trace.meta.get(WAN_COLLECTIVE_BYTES, 0)),
        peak_memory=dict(peak_memory or {}),
        iterations=n_it,
        bubble_fraction=bubble_time / (num_ranks * denom) if num_ranks else 0.0,
    )
