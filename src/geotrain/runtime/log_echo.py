"""A rank's WAN outage, said on the launcher's console.

The built-in launcher sends each rank's stderr to RUN_DIR/logs/rank<R>.log, so a link that went
down was visible only there: the console showed nothing while the run waited ("no progress for
30 s" went to the rank logs). `OutageEcho` reads the new lines of every rank log as the launcher
polls and prints the transport's outage lines (a connection lost, a link still down, a transfer
without progress, a reconnect) on the console, each distinct line at most once per 10 s.
Under torchrun a rank's stderr is its console already.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

OUTAGE_WORDS = ("no progress for", "still down after", "reconnected after", "connection lost", "stayed down",
                ") lost (", "cannot accept a connection")
PERIOD_S = 0.5


class OutageEcho:
    def __init__(self, logs: Path, world_size: int, out=None):
        self.files = [Path(logs) / f"rank{r}.log" for r in range(world_size)]
        self.offsets = [0] * world_size
        self.partial = [b""] * world_size
        self.out = out
        self.said: dict[str, float] = {}
        self.last = 0.0

    def poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < PERIOD_S:
            return
        self.last = now
        for r, path in enumerate(self.files):
            try:
                size = path.stat().st_size
                if size <= self.offsets[r]:
                    continue
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read(size - self.offsets[r])
            except OSError:
                continue
            self.offsets[r] += len(data)
            *lines, self.partial[r] = (self.partial[r] + data).split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").strip()
                if line.startswith("geotrain wan:") and any(w in line for w in OUTAGE_WORDS):
                    self._say(line, now)

    def _say(self, line: str, now: float) -> None:
        if now - self.said.get(line, -1e9) < 10:
            return
        self.said[line] = now
        print(line, file=self.out or sys.stderr, flush=True)
