"""One event schema for predicted and measured timelines.

kind is one of:
  forward, backward, backward_input, backward_weight, optimizer, prefill -- the GPU computes;
  allreduce -- DP gradient reduction inside the DC (the rank waits on the network);
  recv_wait -- the rank is blocked waiting for an activation or gradient to arrive;
  transfer  -- a tensor moving over a link: rank is the sender, start is when it entered the
               link (after queueing), end when the last byte arrived; `link` names the link.
  turn      -- measured only: a temporal turn a rank's transport held on `link` (granted -> released);
               it runs beside the rank's compute, on the link.
Times are seconds from the start of the run (sim: iteration 0 starts at 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float (at any depth of dicts, lists and tuples) as None:
    what a JSON file of ours may hold (bare NaN / Infinity are not JSON; other readers refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_text(value: Any, **kw: Any) -> str:
    """Strict JSON of `value` (`finite` first: never a bare NaN)."""
    return json.dumps(finite(value), allow_nan=False, **kw)


COMPUTE_KINDS = frozenset({"forward", "backward", "backward_input", "backward_weight", "optimizer", "prefill"})
TRAINING_COMPUTE_KINDS = COMPUTE_KINDS - {"prefill"}


@dataclass(slots=True)
class Event:
    rank: int
    kind: str
    start: float
    end: float
    stage: int = -1
    mb: int = -1
    bytes: int = 0
    link: str = ""
    iteration: int = 0
    peer: int = -1            # transfer: receiving rank

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    """A list of events plus what produced them (source: "sim" or "measured")."""

    events: list[Event] = field(default_factory=list)
    num_ranks: int = 0
    source: str = "sim"
    meta: dict[str, Any] = field(default_factory=dict)

    def by_rank(self) -> dict[int, list[Event]]:
        out: dict[int, list[Event]] = {r: [] for r in range(self.num_ranks)}
        for e in self.events:
            out.setdefault(e.rank, []).append(e)
        for evs in out.values():
            evs.sort(key=lambda e: (e.start, e.end))
        return out

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            f.write(json_text({"header": {"num_ranks": self.num_ranks, "source": self.source,
                                          "meta": self.meta}}) + "\n")
            for e in self.events:
                f.write(json_text(asdict(e)) + "\n")

    @classmethod
    def read_jsonl(cls, path: str | Path) -> Trace:
        t = cls()
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                if "header" in d:
                    h = d["header"]
                    t.num_ranks, t.source, t.meta = h["num_ranks"], h["source"], h.get("meta", {})
                else:
                    t.events.append(Event(**d))
        return t
