"""The plan: the one description of a training layout that simulator and runtime both consume.

Layout rules it encodes: pipeline stages may sit in different DCs (joined by the WAN); every DP
replica of a stage sits in the stage's DC, so the gradient reduction never crosses the WAN; TP
stays inside a node. Ranks are numbered stage-major -- rank = (stage * dp + replica) * tp + t --
so the ranks of one DC are contiguous.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StagePlan:
    """One physical pipeline stage: its DC and its model units.

    chunks: unit ranges [start, end) this stage holds; one chunk normally, several for
    interleaved schedules (chunk c of stage s is virtual stage c * pp + s)."""

    dc: str
    chunks: tuple[tuple[int, int], ...]

    @property
    def units(self) -> list[int]:
        return [u for a, b in self.chunks for u in range(a, b)]


@dataclass(frozen=True)
class LinkPlan:
    """How a WAN boundary between consecutive stages is used (both directions).

    sharing: "fair" -- concurrent transfers split the link; "temporal" -- transfers take turns,
    each at the full rate, in `order` (DP pipeline indices), pipelines starting `stagger_s` apart.
    """

    src_dc: str
    dst_dc: str
    connections: int = 1
    sharing: str = "fair"
    order: tuple[int, ...] = ()
    stagger_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    dp: int
    micro_batch: int
    num_microbatches: int
    schedule: str = "1f1b"
    tp: int = 1
    precision: str = "bf16"
    checkpointing: str = "none"
    sharding: str = "replicate"
    links: tuple[LinkPlan, ...] = ()
    extra_warmup: tuple[int, ...] = ()       # wan-1f1b: extra warm-up forwards per stage
    pipeline_offsets: tuple[float, ...] = () # start offset (s) of each DP pipeline
    name: str = "plan"
    notes: tuple[str, ...] = field(default=())

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def virtual_per_stage(self) -> int:
        return len(self.stages[0].chunks)

    @property
    def num_ranks(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches

    def rank(self, stage: int, replica: int, t: int = 0) -> int:
        return (stage * self.dp + replica) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp index) of a rank."""
        t = rank % self.tp
        sr = rank // self.tp
        return sr // self.dp, sr % self.dp, t

    def gpus_per_dc(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stages:
            out[s.dc] = out.get(s.dc, 0) + self.dp * self.tp
        return out

    def link_between(self, a: str, b: str) -> LinkPlan | None:
        for lp in self.links:
            if {lp.src_dc, lp.dst_dc} == {a, b}:
                return lp
        return None

    def virtual_units(self) -> list[tuple[int, int]]:
        """Unit range of each virtual stage, in pipeline order."""
        pp = self.pp
        return [self.stages[v % pp].chunks[v // pp] for v in range(pp * self.virtual_per_stage)]

    def with_(self, **kw: Any) -> Plan:
        return replace(self, **kw)

    # -- serialization --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["stages"] = tuple(
            StagePlan(dc=s["dc"], chunks=tuple(tuple(c) for c in s["chunks"])) for s in d["stages"]
        )
        d["links"] = tuple(LinkPlan(**{**lp, "order": tuple(lp.get("order", ()))}) for lp in d.get("links", ()))
        for k in ("extra_warmup", "pipeline_offsets", "notes"):
            d[k] = tuple(d.get(k, ()))
        return cls(**d)


def save_plan(path: str | Path, plan: Plan, spec_path: str | None = None,
              extra: dict[str, Any] | None = None) -> None:
    """Write a plan file: the plan plus the experiment spec it was made for."""
    from geotrain.errors import GeotrainError

    doc = {"format": "geotrain-plan/1", "spec": spec_path, "plan": plan.to_dict(), **(extra or {})}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        raise GeotrainError(f"cannot write plan file {path}: {e.strerror or e}") from None


def load_plan(path: str | Path) -> tuple[Plan, dict[str, Any]]:
    """Read a plan file; returns the plan and the whole document (spec path, estimates)."""
    from geotrain.errors import SpecError

    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("format") != "geotrain-plan/1":
            raise SpecError(str(path), "format", "not a geotrain plan file")
        return Plan.from_dict(doc["plan"]), doc
    except FileNotFoundError:
        raise SpecError(str(path), "", "file not found") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecError(str(path), "plan", f"malformed plan file ({e})") from None
