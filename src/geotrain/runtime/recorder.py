"""Measured trace: each rank records the simulator's event schema with real timestamps, off the hot path.

Times are seconds since a t0 that rank 0 broadcasts at start (wall clock), so events of different ranks
share one time axis (exact on one machine, NTP-accurate across machines). Each rank streams its events
to its own file, RUN_DIR/trace/rank<R>.jsonl on its own host, and keeps only per-iteration totals in
memory (bounded however long the run); the reporting rank merges the files it can see
(`trace.merge`), and `geotrain report` merges those copied from other hosts -- no trace crosses the
network.

On a CUDA rank an action's work runs asynchronously on the GPU. `mark()` records a CUDA event on the
current stream (no synchronisation) where a CPU rank reads the clock; an event between two marks is
resolved once both have completed on the GPU (`flush`, at each iteration's end: only finished ones, so
the GPU keeps running ahead), its times the GPU's, placed on the wall clock through one anchor event
synchronised once at start. Host-side times (`now()`: transfers, turns, BubbleTea's waits) never wait.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import IO

import torch

from geotrain.trace.schema import Event, json_text

WAIT_KINDS = {"recv_wait"}
MAX_PENDING = 4096          # unresolved GPU events held at most; beyond, the oldest are waited for


class _Mark:
    """A point on a CUDA stream: its event, and the host time it was enqueued (a fallback)."""

    __slots__ = ("event", "host")

    def __init__(self, event, host: float):
        self.event, self.host = event, host


class Recorder:
    """This rank's trace. `path`: where its events stream (None: kept nowhere, totals only);
    `device`: a CUDA device makes `mark()` record CUDA events."""

    def __init__(self, rank: int, t0: float, enabled: bool = True, path: Path | None = None,
                 device: torch.device | None = None, flush_lines: int = 256):
        self.rank, self.t0, self.enabled = rank, t0, enabled
        self.iteration = 0
        self.cuda = enabled and device is not None and device.type == "cuda"
        self.path = Path(path) if path is not None and enabled else None
        self._file: IO[str] | None = None
        self._lines: list[str] = []
        self._flush_lines = flush_lines
        self._pending: list[tuple[Event, object, object]] = []     # GPU events awaiting their times
        self._by_iteration: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._anchor = None                      # (CUDA event, host time - t0) synchronised once
        self.count = 0

    # -- taking times ------------------------------------------------------------------------------
    def now(self) -> float:
        """Host wall clock since t0 (never waits for the device)."""
        return time.time() - self.t0

    def mark(self):
        """A point in this rank's work: on CUDA a CUDA event on the current stream (no synchronisation),
        else the host clock (`now()`)."""
        if not self.cuda:
            return self.now()
        if self._anchor is None:
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()             # once per run: where the GPU's clock sits on the wall clock
            self._anchor = (anchor, self.now())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return _Mark(ev, self.now())

    def add(self, kind: str, start, end, stage: int = -1, mb: int = -1, nbytes: int = 0, peer: int = -1,
            link: str = "") -> None:
        """An event from `start` to `end`: floats (`now()`) or marks (`mark()`)."""
        if not self.enabled:
            return
        e = Event(rank=self.rank, kind=kind, start=_host(start), end=_host(end), stage=stage, mb=mb, bytes=nbytes,
                  iteration=self.iteration, peer=peer, link=link)
        if isinstance(start, _Mark) or isinstance(end, _Mark):
            self._pending.append((e, start, end))
            if len(self._pending) > MAX_PENDING:
                self.flush(wait=True, keep=MAX_PENDING // 2)
            return
        self._keep(e)

    # -- resolving, writing ---------------------------------------------------------------------------
    def flush(self, wait: bool = False, keep: int = 0) -> None:
        """Resolve the GPU events that have completed (in order; `wait`: wait for them, down to `keep`
        still pending), and write buffered lines to the file."""
        done, n = 0, len(self._pending)
        for e, start, end in self._pending:
            last = end if isinstance(end, _Mark) else start
            if wait:
                if n - done <= keep:
                    break
                last.event.synchronize()
            elif not last.event.query():
                break
            e.start, e.end = self._gpu_time(start), self._gpu_time(end)
            self._keep(e)
            done += 1
        del self._pending[:done]
        self._write()

    def close(self) -> None:
        """Resolve everything (waits for the device once) and close the file."""
        if self._pending:
            self.flush(wait=True)
        self._write(force=True)
        if self.path is not None and self._file is None:     # no events: an empty file says "nothing", not "missing"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        if self._file is not None:
            self._file.close()
            self._file = None

    def _gpu_time(self, point) -> float:
        if not isinstance(point, _Mark):
            return point
        anchor, at = self._anchor
        return at + anchor.elapsed_time(point.event) / 1e3

    def _keep(self, e: Event) -> None:
        self._by_iteration[e.iteration][e.kind] += e.duration
        self.count += 1
        if self.path is not None:
            self._lines.append(json_text(asdict(e)) + "\n")
            if len(self._lines) >= self._flush_lines:
                self._write(force=True)

    def _write(self, force: bool = False) -> None:
        if self.path is None or not self._lines or (not force and len(self._lines) < self._flush_lines):
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w")  # noqa: SIM115 -- closed in close()
        self._file.write("".join(self._lines))
        self._file.flush()
        self._lines.clear()

    def totals(self, first_iteration: int = 0) -> dict[str, float]:
        """Seconds per event kind (iterations >= first_iteration), of the events resolved so far."""
        out: dict[str, float] = defaultdict(float)
        for it, kinds in self._by_iteration.items():
            if it >= first_iteration:
                for k, v in kinds.items():
                    out[k] += v
        return dict(out)


def _host(point) -> float:
    return point.host if isinstance(point, _Mark) else point
