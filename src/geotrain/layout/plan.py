"""The plan: the one description of a training layout that simulator and runtime both consume.

Layout rules it encodes: pipeline stages may sit in different DCs (joined by the WAN); every DP
replica of a stage sits in the stage's DC, so the gradient reduction never crosses the WAN --
except in a region plan (`replica_dcs`): every stage in one DC's pipeline, DP pipeline d in DC
replica_dcs[d], so only the gradient reduction crosses the (fast, regional) links. TP stays
inside a node; stages may run different tp (a stage's `tp`, where its DC's nodes or GPUs differ).
The ranks of one DC are contiguous, so one torchrun per DC (node ranks contiguous per host)
starts them: an ordinary plan numbers them stage-major -- stage s holds dp x tp_s ranks after
those of the stages before it, replica d's TP group at d * tp_s (with one tp: rank = (stage * dp
+ replica) * tp + t) -- and a region plan pipeline-major, its pipelines grouped by DC (first
appearance in replica_dcs), each pipeline's stages in order, TP innermost. `Plan.rank`/`Plan.coords`
read one table built once per plan (`rank_table`), so nothing else computes a rank by hand.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from geotrain.errors import GeotrainError, SpecError
from geotrain.layout.plan_fields import plan_field_problem
from geotrain.layout.workers import OuterPlan
from geotrain.spec.document import spec_document, spec_from_document
from geotrain.spec.load import Spec, load_spec


@dataclass(frozen=True)
class StagePlan:
    """One physical pipeline stage: its DC and its model units.

    chunks: unit ranges [start, end) this stage holds; one chunk normally, several for
    interleaved schedules (chunk c of stage s is virtual stage c * pp + s).
    checkpointing: this stage's own mode when it differs from the plan's (the planner checkpoints
    only the stages that need it: under 1F1B the first stages hold the most micro-batches).
    tp: this stage's tensor-parallel degree when it differs from the plan's (a stage on 4-GPU
    nodes beside one on 8-GPU nodes); None is the plan's `tp`, so plans of one tp read as before."""

    dc: str
    chunks: tuple[tuple[int, int], ...]
    checkpointing: str | None = None
    tp: int | None = None   # this stage's tensor-parallel degree when it differs from the plan's

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
    # Pipeline boundaries crossing this link sent compressed (costs.compression): "none", "bf16",
    # "fp8-e4m3", "fp8-e5m2", "int8"; rank > 0 sends a rank-`rank` factorisation instead.
    compression: str = "none"
    rank: int = 0


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
    replica_dcs: tuple[str, ...] = ()        # region plan: the DC of each DP pipeline (else the stage's DC)
    name: str = "plan"
    notes: tuple[str, ...] = field(default=())
    outer: OuterPlan | None = None           # DiLoCo across workers (None: one synchronous job)
    worker: int = 0                          # which worker's view this is (stages in its DCs)

    @property
    def num_workers(self) -> int:
        return self.outer.num_workers if self.outer is not None else 1

    def worker_plan(self, w: int) -> Plan:
        """Worker w's view of a DiLoCo plan: its stages in its DCs, the links among them; the
        ranks of one worker form one torch.distributed job (num_ranks of them)."""
        if self.outer is None:
            if w != 0:
                raise ValueError("a plan without workers has only worker 0")
            return self
        dcs = self.outer.workers[w]
        mine = set(dcs)
        return replace(self, stages=tuple(replace(st, dc=dc) for st, dc in zip(self.stages, dcs, strict=True)),
                       links=tuple(lp for lp in self.links if {lp.src_dc, lp.dst_dc} <= mine), worker=w)

    def inner_plan(self) -> Plan:
        """This worker's layout as an ordinary plan (no workers): what one worker runs per step."""
        return replace(self, outer=None, worker=0,
                       links=tuple(lp for lp in self.links if {lp.src_dc, lp.dst_dc} <= {st.dc for st in self.stages}))

    def worker_dcs(self) -> list[str]:
        """Every DC a worker of the plan uses, worker by worker (each once)."""
        if self.outer is None:
            return self.dcs_by_rank()
        return list(dict.fromkeys(dc for w in range(self.num_workers) for dc in self.worker_plan(w).dcs_by_rank()))
    ep: int = 1                              # expert parallelism: ep consecutive replicas of a stage split the experts

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def virtual_per_stage(self) -> int:
        return len(self.stages[0].chunks)

    def stage_tp(self, stage: int) -> int:
        """The tensor-parallel degree stage `stage` runs: its own, else the plan's."""
        return self.stages[stage].tp or self.tp

    def boundary_scattered(self, sender: int, receiver: int) -> bool:
        """Whether a boundary tensor between these stages moves as 1/tp slices, one per TP index,
        that the receiver all-gathers (equal tp > 1; runtime/interpreter.py) -- else whole copies."""
        t = self.stage_tp(sender)
        return t > 1 and t == self.stage_tp(receiver)

    def boundary_copies(self, sender: int, receiver: int) -> int:
        """Whole tensors' worth of bytes a boundary moves sender -> receiver per micro-batch and
        pipeline: one when scattered, else one copy per receiving TP rank. Either way it runs as
        stage_tp(receiver) parallel flows."""
        return 1 if self.boundary_scattered(sender, receiver) else self.stage_tp(receiver)

    @cached_property
    def stage_tps(self) -> tuple[int, ...]:
        return tuple(st.tp or self.tp for st in self.stages)

    @cached_property
    def mixed_tp(self) -> bool:
        """Whether stages run different tensor-parallel degrees."""
        return len(set(self.stage_tps)) > 1

    def tp_label(self) -> str:
        """The plan's tp in one phrase: one degree, or the degree of each stage."""
        tps = self.stage_tps
        return str(tps[0]) if len(set(tps)) == 1 else "per stage " + "/".join(map(str, tps))

    @property
    def num_ranks(self) -> int:
        return self.dp * sum(self.stage_tps)

    @property
    def global_batch(self) -> int:
        """Sequences per step over every worker (a DiLoCo plan's workers each train dp x m x mb)."""
        return self.num_workers * self.dp * self.micro_batch * self.num_microbatches

    @cached_property
    def rank_table(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """rank_table[stage][replica][t]: the global rank of every (stage, replica, tp index), in
        the numbering of the module docstring. Built once per plan (the dataclass is frozen;
        cached_property stores beside the fields, so equality, asdict and replace ignore it)."""
        if self.replica_dcs:
            groups = list(dict.fromkeys(self.replica_dcs))
            replicas = sorted(range(self.dp), key=lambda d: groups.index(self.replica_dcs[d]))
            order = [(s, d) for d in replicas for s in range(self.pp)]
        else:
            order = [(s, d) for s in range(self.pp) for d in range(self.dp)]
        tps = self.stage_tps
        table = [[[0] * tps[s] for _ in range(self.dp)] for s in range(self.pp)]
        first = 0
        for s, d in order:   # each TP group: tp_s consecutive ranks
            table[s][d] = list(range(first, first + tps[s]))
            first += tps[s]
        return tuple(tuple(tuple(row) for row in stage) for stage in table)

    @cached_property
    def _coords_table(self) -> tuple[tuple[int, int, int], ...]:
        out: list[tuple[int, int, int]] = [(0, 0, 0)] * self.num_ranks
        for s, stage in enumerate(self.rank_table):
            for d, row in enumerate(stage):
                for t, r in enumerate(row):
                    out[r] = (s, d, t)
        return tuple(out)

    def rank(self, stage: int, replica: int, t: int = 0) -> int:
        """The global rank of TP index t of `replica` of `stage`."""
        return self.rank_table[stage][replica][t]

    def stage_ranks(self, stage: int) -> list[int]:
        """Every rank of `stage`: each replica's TP group in turn (rank_table[stage], flattened)."""
        return [r for row in self.rank_table[stage] for r in row]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp index) of a rank."""
        return self._coords_table[rank]

    def dc_of_rank(self, rank: int) -> str:
        """The DC a rank runs in."""
        s, d, _ = self.coords(rank)
        return self.dc_of(s, d)

    def dcs_by_rank(self) -> list[str]:
        """The DCs the plan's ranks run in, in rank order (each once)."""
        return list(dict.fromkeys(self.dc_of_rank(r) for r in range(self.num_ranks)))

    def ranks_of_dc(self, dc: str) -> list[int]:
        """The ranks in `dc`, ascending (a contiguous range: see the module docstring)."""
        return [r for r in range(self.num_ranks) if self.dc_of_rank(r) == dc]

    def dc_of(self, stage: int, replica: int) -> str:
        """The DC of one stage replica."""
        return self.replica_dcs[replica] if self.replica_dcs else self.stages[stage].dc

    def gpus_per_dc(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.outer is not None:      # every worker's GPUs (one worker's: inner_plan())
            for w in range(self.num_workers):
                for dc, n in self.worker_plan(w).inner_plan().gpus_per_dc().items():
                    out[dc] = out.get(dc, 0) + n
            return out
        if self.replica_dcs:
            for dc in self.replica_dcs:
                out[dc] = out.get(dc, 0) + sum(self.stage_tps)
            return out
        for s in self.stages:
            out[s.dc] = out.get(s.dc, 0) + self.dp * (s.tp or self.tp)
        return out

    def replicas_per_dc(self) -> list[tuple[str, int]]:
        """Region plan: (DC, DP pipelines there) in first-appearance order; else [(stage 0's DC, dp)]."""
        out: dict[str, int] = {}
        for dc in self.replica_dcs or (self.stages[0].dc,) * self.dp:
            out[dc] = out.get(dc, 0) + 1
        return list(out.items())

    def stage_checkpointing(self, stage: int) -> str:
        """The checkpointing mode stage `stage` runs: its own, else the plan's."""
        return self.stages[stage].checkpointing or self.checkpointing

    def checkpointing_label(self) -> str:
        """The plan's checkpointing in one phrase: one mode, or the mode of each stage."""
        modes = [self.stage_checkpointing(s) for s in range(self.pp)]
        if len(set(modes)) == 1:
            return modes[0]
        return "per stage " + "/".join(modes)

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
        d = asdict(self)
        if d["ep"] == 1:
            del d["ep"]            # a dense plan's file as before expert parallelism
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        d["stages"] = tuple(
            StagePlan(dc=s["dc"], chunks=tuple(tuple(c) for c in s["chunks"]), checkpointing=s.get("checkpointing"),
                      tp=s.get("tp"))
            for s in d["stages"]
        )
        d["links"] = tuple(LinkPlan(**{**lp, "order": tuple(lp.get("order", ()))}) for lp in d.get("links", ()))
        if d.get("outer") is not None:
            o = dict(d["outer"])
            o["workers"] = tuple(tuple(w) for w in o.get("workers", ()))
            d["outer"] = OuterPlan(**o)
        for k in ("extra_warmup", "pipeline_offsets", "replica_dcs", "notes"):
            d[k] = tuple(d.get(k, ()))
        return cls(**d)


PLAN_FORMAT, PLAN_VERSION = "geotrain-plan", 2


class PlanFile(BaseModel):
    """A plan file's envelope. `resolved_spec` is the experiment as validated when the plan was made
    (spec.document), so the file trains and simulates wherever it is copied; `spec` only says
    which TOML that was. Other keys (the planner's estimates) are kept as they are."""

    model_config = ConfigDict(extra="allow")
    format: Literal["geotrain-plan"]
    version: Literal[2]
    spec: str | None = None
    resolved_spec: dict[str, Any] | None = None
    plan: dict[str, Any]


def plan_document(plan: Plan, spec_path: str | None = None, extra: dict[str, Any] | None = None,
                  spec: Spec | None = None) -> dict[str, Any]:
    """A plan file's content (see `save_plan`)."""
    resolved = spec_document(spec) if spec is not None else None
    return {"format": PLAN_FORMAT, "version": PLAN_VERSION, "spec": spec_path or (resolved or {}).get("source"),
            "resolved_spec": resolved, "plan": plan.to_dict(), **(extra or {})}


def save_plan(path: str | Path, plan: Plan, spec_path: str | None = None,
              extra: dict[str, Any] | None = None, spec: Spec | None = None) -> None:
    """Write a plan file: the plan plus the experiment it was made for -- `spec` embedded whole
    when given (then `spec_path` defaults to the TOML it came from)."""
    doc = plan_document(plan, spec_path, extra, spec)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        raise GeotrainError(f"cannot write plan file {path}: {e.strerror or e}") from None


def load_plan(path: str | Path) -> tuple[Plan, dict[str, Any]]:
    """Read a plan file; returns the plan and the whole document (spec, estimates).

    Anything that is not a well-formed plan file of this version (a directory, a binary or
    non-object JSON file, an older or foreign format, fields of the wrong type, zero connections,
    negative or infinite offsets) is a SpecError naming the file, so commands print one line
    instead of a traceback."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SpecError(where, "", "file not found") from None
    except IsADirectoryError:
        raise SpecError(where, "", "is a directory, not a plan file") from None
    except OSError as e:
        raise SpecError(where, "", f"cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise SpecError(where, "", "not a text file (a plan file is the JSON `geotrain plan --out` writes)") from None
    try:
        doc = json.loads(text)
    except ValueError as e:                 # not JSON, or an integer of thousands of digits
        raise SpecError(where, "plan", f"malformed plan file ({str(e)[:200]})") from None
    except RecursionError:
        raise SpecError(where, "plan", "malformed plan file (nested thousands of levels deep)") from None
    return plan_from_document(doc, where), doc


def plan_from_document(doc: Any, where: str) -> Plan:
    """The plan of a plan file's content (`plan_document`), checked; a SpecError naming `where` if not."""
    if isinstance(doc, dict) and doc.get("format") == "geotrain-plan/1":
        raise SpecError(where, "format", "a version-1 plan file (from an older geotrain, naming its spec by path): "
                                         "make it again with `geotrain plan`")
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise SpecError(where, "format", "not a geotrain plan file")
    if doc.get("version") != PLAN_VERSION:
        raise SpecError(where, "version", f"plan file version {doc.get('version')!r}; this geotrain reads "
                                          f"version {PLAN_VERSION} (make the plan again with `geotrain plan`)")
    try:
        PlanFile.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise SpecError(where, ".".join(str(x) for x in err["loc"]), err["msg"]) from None
    try:
        plan = Plan.from_dict(doc["plan"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SpecError(where, "plan", f"malformed plan file ({str(e)[:200]})") from None
    problem = plan_field_problem(plan)
    if problem:
        raise SpecError(where, problem[0], problem[1])
    return plan


def plan_spec(doc: dict[str, Any], path: str | Path) -> Spec:
    """The experiment a loaded plan file was made for: its embedded spec, else the TOML it names
    (relative to the plan file when not found as given)."""
    if doc.get("resolved_spec") is not None:
        return spec_from_document(doc["resolved_spec"], str(path))
    if not doc.get("spec"):
        raise SpecError(str(path), "spec", "the plan file does not name the experiment spec it was made for")
    spec_path = Path(doc["spec"])
    if not spec_path.is_absolute() and not spec_path.exists():
        spec_path = Path(path).parent / spec_path
    return load_spec(spec_path)
