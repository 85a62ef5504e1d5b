"""Measured trace: each rank records the simulator's event schema with real timestamps.

Times are seconds since a t0 that rank 0 broadcasts at start (wall clock), so events of
different ranks share one time axis (exact on one machine, NTP-accurate across machines).
Each rank writes its own JSONL file and sends its lines (bytes) to the reporting rank, which
merges them after the run -- no Python objects cross the network.

On a CUDA rank the work of an event runs asynchronously on the GPU, so `now()` first waits for
the device (`sync`, torch.cuda.synchronize): an event that ends on the GPU ends when the GPU
finished it, not when Python queued it. That costs the overlap of one action with the next, so
it happens only while the trace is enabled.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from geotrain.trace.schema import Event, Trace, json_text

WAIT_KINDS = {"recv_wait"}


class Recorder:
    def __init__(self, rank: int, t0: float, enabled: bool = True, sync: Callable[[], object] | None = None):
        self.rank, self.t0, self.enabled, self.sync = rank, t0, enabled, sync
        self.events: list[Event] = []
        self.iteration = 0

    def now(self) -> float:
        if self.sync is not None and self.enabled:
            self.sync()
        return time.time() - self.t0

    def add(self, kind: str, start: float, end: float, stage: int = -1, mb: int = -1, nbytes: int = 0,
            peer: int = -1, link: str = "") -> None:
        if self.enabled:
            self.events.append(Event(rank=self.rank, kind=kind, start=start, end=end, stage=stage, mb=mb,
                                     bytes=nbytes, iteration=self.iteration, peer=peer, link=link))

    def totals(self, first_iteration: int = 0) -> dict[str, float]:
        """Seconds per event kind (iterations >= first_iteration)."""
        out: dict[str, float] = defaultdict(float)
        for e in self.events:
            if e.iteration >= first_iteration:
                out[e.kind] += e.duration
        return dict(out)

    def jsonl(self) -> bytes:
        """The events as JSON lines: the rank's trace file, and what it sends to the reporting rank."""
        return "".join(json_text(asdict(e)) + "\n" for e in self.events).encode()


def merge_trace_lines(files: list[bytes], out: Path, num_ranks: int, meta: dict) -> Trace:
    """The ranks' trace files (as `Recorder.write` wrote them) merged into one trace at `out`."""
    trace = Trace(num_ranks=num_ranks, source="measured", meta=meta)
    for data in files:
        trace.events.extend(Event(**json.loads(line)) for line in data.decode().splitlines() if line.strip())
    trace.events.sort(key=lambda e: (e.start, e.rank))
    trace.write_jsonl(out)
    return trace
