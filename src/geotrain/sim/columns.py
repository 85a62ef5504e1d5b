"""The simulator's trace: column arrays built from the engine's result, Event objects on demand.

A thousand-GPU iteration has hundreds of thousands of events; building an `Event` for each
would cost more than simulating them. `SimTrace` is a `Trace` whose `columns()` are assembled
with numpy straight from the engine's per-slot start/arrival arrays and the compiled program;
`events` (and so `by_rank`, `write_jsonl`) materializes the Event list the first time it is
asked for.

Event conventions (see trace/schema.py): compute and allreduce events are repeated on every
tensor-parallel rank of a tp group (the group moves as one; stages may differ in tp); transfers
are recorded once per group, from its first rank to the receiving group's first rank, with
`stage` = the sending virtual stage and the bytes of every copy the boundary moves (one per
receiving TP rank, sim/program.py). recv_wait events appear only where the GPU really waited.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from geotrain.sim.engine import EngineResult
from geotrain.sim.program import ALLREDUCE, COMPUTE, RECV, SEND_INTRA, SEND_SYNC, SEND_WAN, Program
from geotrain.trace.metrics import KINDS, Columns, columns_from_events
from geotrain.trace.schema import Event, Trace


def build_columns(prog: Program, res: EngineResult, rank_table) -> Columns:
    """rank_table: the plan's rank_table ([stage][replica][t] -> rank), so the trace numbers ranks
    as the runtime does; stages may differ in tp (rows of different length)."""
    dp = prog.dp
    widths = [len(stage[0]) for stage in rank_table]
    unit_rank = np.full((len(widths) * dp, max(widths)), -1, dtype=np.int64)  # row s * dp + replica: the engine's unit
    for s, stage in enumerate(rank_table):
        for d, row in enumerate(stage):
            unit_rank[s * dp + d, :len(row)] = row
    P = len(prog.stages)
    starts = [np.array(res.start[s * dp:(s + 1) * dp], dtype=float).reshape(dp, -1) for s in range(P)]
    arrivals = [np.array(res.arrival[s * dp:(s + 1) * dp], dtype=float).reshape(dp, -1) for s in range(P)]
    ends = None if res.end is None else [np.array(res.end[s * dp:(s + 1) * dp], dtype=float).reshape(dp, -1)
                                         for s in range(P)]
    replica = np.arange(dp)[:, None]
    names = ("rank", "kind", "stage", "mb", "iteration", "peer", "bytes", "link", "start", "end")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in names}

    def add(cols: dict[str, np.ndarray], tp: int, keep: np.ndarray | None = None, per_tp: bool = True) -> None:
        """cols: per-replica rows (dp x k arrays, or length-k rows broadcast over replicas), on
        each of the stage's `tp` ranks when per_tp."""
        shape = cols["start"].shape
        flat = {k: np.broadcast_to(v, shape)[keep] if keep is not None else np.broadcast_to(v, shape).ravel()
                for k, v in cols.items()}
        for t in range(tp) if per_tp else range(1):
            for k in names:
                if k == "rank":
                    parts[k].append(unit_rank[flat["unit"], t])
                elif k == "peer":
                    parts[k].append(unit_rank[flat["peer"], 0] if "peer" in flat else np.full(len(flat["start"]), -1))
                elif k in flat:
                    parts[k].append(flat[k])
                else:
                    parts[k].append(np.full(len(flat["start"]), -1 if k == "link" else 0))

    for s, p in enumerate(prog.stages):
        ops = np.array(p.ops)
        row = {"kind": np.array(p.kind), "stage": np.array(p.vstage), "mb": np.array(p.mb),
               "iteration": np.array(p.iteration)}
        dur = np.array(p.dur)
        S, B = starts[s], arrivals[s]
        unit = s * dp + replica
        tp = widths[s]

        def pick(m: np.ndarray, row: dict = row) -> dict[str, np.ndarray]:
            return {k: v[m] for k, v in row.items()}

        shown = row["kind"] >= 0           # kind -1: no event (the gradient norm's scalar all-reduce and sends)
        m = ((ops == COMPUTE) | (ops == ALLREDUCE)) & shown
        e = S[:, m] + dur[m]
        if ends is not None:   # a core pool: computes end when their shared work is done
            e = np.where(ops[m] == COMPUTE, ends[s][:, m], e)
        add({**pick(m), "unit": unit, "start": S[:, m], "end": e}, tp)
        m = ops == RECV
        if m.any():
            add({**pick(m), "unit": unit, "start": S[:, m], "end": B[:, m]}, tp, keep=B[:, m] > S[:, m])
        m = ((ops == SEND_INTRA) | (ops == SEND_WAN) | (ops == SEND_SYNC)) & shown
        if m.any():
            ds = np.array(p.dst_stage)[m]
            dslot = np.array(p.dst_slot)[m]
            end = np.empty((dp, len(ds)))
            for d_stage in np.unique(ds):
                sel = ds == d_stage
                end[:, sel] = arrivals[d_stage][:, dslot[sel]]
            add({**pick(m), "unit": unit, "start": S[:, m], "end": end, "peer": ds[None, :] * dp + replica,
                 "bytes": np.array(p.nbytes)[m], "link": np.array(p.link)[m]}, tp, per_tp=False)

    cat = {k: np.concatenate(v) for k, v in parts.items()}
    ints = {k: cat[k].astype(np.int64) for k in names if k not in ("start", "end")}
    return Columns(start=cat["start"].astype(float), end=cat["end"].astype(float), kind_names=KINDS,
                   link_names=tuple(prog.link_names), **ints)


class SimTrace(Trace):
    """A Trace whose events are built lazily from the simulator's columns."""

    def __init__(self, prog: Program, res: EngineResult, rank_table, num_ranks: int, meta: dict[str, Any]):
        self._prog, self._res, self._rank_table = prog, res, rank_table
        self._columns: Columns | None = None
        self._events: list[Event] | None = None
        self.num_ranks = num_ranks
        self.source = "sim"
        self.meta = meta

    def columns(self) -> Columns:
        """The events as arrays. If the Event list was replaced or grown since (e.g. prefill
        events appended), the columns are rebuilt from it."""
        if self._events is not None and (self._columns is None or len(self._columns) != len(self._events)):
            self._columns = columns_from_events(self._events)
        elif self._columns is None:
            self._columns = build_columns(self._prog, self._res, self._rank_table)
            self._res = None   # the columns hold everything now; free the per-slot lists
        return self._columns

    @property  # type: ignore[override]
    def events(self) -> list[Event]:
        if self._events is None:
            self._events = self.columns().to_events()
        return self._events

    @events.setter
    def events(self, value: list[Event]) -> None:
        self._events = list(value)
        self._columns = None

    def write_jsonl(self, path) -> None:
        """Same file as Trace.write_jsonl, written straight from the columns (no Event objects)."""
        if self._events is not None:
            return super().write_jsonl(path)
        c = self.columns()
        kn, ln = c.kind_names, c.link_names
        rows = zip(c.rank.tolist(), c.kind.tolist(), c.start.tolist(), c.end.tolist(), c.stage.tolist(),
                   c.mb.tolist(), c.bytes.tolist(), c.link.tolist(), c.iteration.tolist(), c.peer.tolist())
        dumps = json.dumps
        with open(path, "w") as f:
            f.write(dumps({"header": {"num_ranks": self.num_ranks, "source": self.source, "meta": self.meta}}) + "\n")
            f.writelines(
                dumps({"rank": r, "kind": kn[k], "start": s, "end": e, "stage": st, "mb": mb, "bytes": b,
                       "link": ln[li] if li >= 0 else "", "iteration": it, "peer": p}) + "\n"
                for r, k, s, e, st, mb, b, li, it, p in rows)

    def __repr__(self) -> str:
        return f"SimTrace(num_ranks={self.num_ranks}, events={len(self.columns())})"
