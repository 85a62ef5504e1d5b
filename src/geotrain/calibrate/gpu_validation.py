"""The simulator against published GPU runs: each run predicted from its spec, pinned plan and
measured profile (`calibrate.gpu_runs`), beside what was measured.

What each prediction is, per run:
* iteration time: `sim.simulate` of the pinned plan with the imported (micro-batch, tp) profile,
  under the runtime option the runs had -- p2p "blocking" (DeepSpeed's pipe engine: blocking NCCL
  send/recv in its TrainSchedule order; the DP all-reduce after the last micro-batch, not
  overlapped, which is geotrain's sync too); `overlapped` is reported beside it as an ablation;
* gradient reduction: the simulated DP sync of the slowest stage (ring over the node links);
* memory: geotrain's peak of allocated bytes per GPU (`layout.peaks`: state, the schedule's
  in-flight micro-batches at the profile's measured saved bytes, the working set) turned into what
  nvidia-smi shows of the whole device: DEVICE = base + (1 + reserve) x allocated -- `base` the
  CUDA context, NCCL and library workspaces, `reserve` what the caching allocator holds beyond the
  live tensors. Those two are the only fitted numbers (least squares on the latest campaign's
  memory, `fit_memory`; leave-one-out errors are reported with them). Nothing of the time is fitted.
Runs whose flags say SUSPECT[run] or DUPLICATE[run] are left out (the flag is named); a suspect
field (SUSPECT[grad_reduction_s]) drops only that comparison, an earlier value the data calls a copy
likewise.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from geotrain.calibrate.gpu_runs import GpuRunData, run_plan, sailor_profile, write_run_spec
from geotrain.costs import CostModel
from geotrain.layout.plan import save_plan
from geotrain.layout.stage_costs import StageCosts, plan_inputs
from geotrain.sim import simulate

SAILOR = {"iteration_mean": 0.089, "iteration_worst": 0.161, "memory_mean": 0.059}   # its paper's Fig. 5
_RUN_FLAG = re.compile(r"^(SUSPECT|DUPLICATE)\[run\]")


@dataclass
class GpuRunRow:
    run: str
    layout: str
    p2p: str
    measured_s: float
    predicted_s: float
    earlier_s: float | None
    measured_grad_s: float | None       # None: the data flags it
    predicted_grad_s: float
    measured_mem: float
    predicted_alloc: float              # peak allocated bytes per GPU (the simulator's)
    earlier_mem: float | None
    excluded: str | None = None         # the flag that leaves the run out
    notes: list[str] = field(default_factory=list)
    predicted_mem: float = 0.0          # nvidia-smi's view, after fit_memory
    overlapped_s: float | None = None   # the same prediction with geotrain's own (overlapped) P2P

    @property
    def error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def earlier_error(self) -> float | None:
        return None if self.earlier_s is None else (self.predicted_s - self.earlier_s) / self.earlier_s

    @property
    def mem_error(self) -> float:
        return (self.predicted_mem - self.measured_mem) / self.measured_mem


def _short(run_id: str) -> str:
    return run_id.rsplit("/", 1)[-1]


def predict_run(data: GpuRunData, run: dict[str, Any], profile: dict[str, Any], workdir: Path,
                p2p: str = "blocking") -> GpuRunRow:
    """One run's prediction (memory as allocated bytes; `fit_memory` adds the device's view)."""
    spec = write_run_spec(data, run, workdir / _short(run["id"]))
    plan = run_plan(run)
    save_plan(workdir / _short(run["id"]) / "plan.json", plan, spec=spec)
    cost = CostModel(spec.model, precision=plan.precision, checkpointing="none", optimizer=spec.job.optimizer,
                     profile=profile)
    costs = StageCosts(cost, spec.cluster)
    res = simulate(spec, plan, costs=costs, p2p=p2p)
    other = simulate(spec, plan, costs=costs, p2p="overlapped" if p2p == "blocking" else "blocking")
    sync = max(plan_inputs(costs, plan).allreduce)
    flags = run.get("flags", [])
    excluded = next((f.split(":")[0] for f in flags if _RUN_FLAG.match(f)), None)
    notes = []
    measured, earlier = run["measured"], run.get("earlier_campaign") or {}
    grad = measured.get("grad_reduction_s")
    if any(f.startswith("SUSPECT[grad_reduction_s]") for f in flags):
        grad, notes = None, notes + ["SUSPECT[grad_reduction_s]"]
    earlier_mem = earlier.get("peak_mem_bytes")
    if earlier_mem is not None and "probably a copy" in earlier.get("note", ""):
        earlier_mem, notes = None, notes + ["earlier memory a copy"]
    return GpuRunRow(run=_short(run["id"]), p2p=p2p,
                     layout=f"pp{plan.pp} dp{plan.dp} tp{plan.tp}, mbs {plan.micro_batch} x {plan.num_microbatches}",
                     measured_s=float(measured["iteration_s"]), predicted_s=res.iteration_time,
                     earlier_s=earlier.get("iteration_s"), measured_grad_s=grad, predicted_grad_s=sync,
                     measured_mem=float(measured["peak_mem_bytes"]),
                     predicted_alloc=max(res.metrics.peak_memory.values()), earlier_mem=earlier_mem,
                     excluded=excluded, notes=notes,
                     overlapped_s=other.iteration_time if p2p == "blocking" else None)


def fit_memory(rows: list[GpuRunRow]) -> tuple[float, float]:
    """(base bytes, reserve fraction) minimising the squared relative error of base + (1 + reserve)
    x allocated against the measured device memory of `rows`."""
    r0 = [1 / r.measured_mem for r in rows]
    r1 = [r.predicted_alloc / r.measured_mem for r in rows]
    y = [1 - r.predicted_alloc / r.measured_mem for r in rows]
    s00, s01, s11 = sum(a * a for a in r0), sum(a * b for a, b in zip(r0, r1)), sum(b * b for b in r1)
    b0, b1 = sum(a * c for a, c in zip(r0, y)), sum(b * c for b, c in zip(r1, y))
    det = s00 * s11 - s01 * s01
    if len(rows) < 2 or det <= 0:
        raise ValueError("fitting the device memory needs two runs of different allocated peaks")
    return (b0 * s11 - b1 * s01) / det, (s00 * b1 - s01 * b0) / det


def device_memory(allocated: float, fit: tuple[float, float]) -> float:
    return fit[0] + (1 + fit[1]) * allocated


@dataclass
class GpuValidation:
    rows: list[GpuRunRow]
    memory_fit: tuple[float, float]
    memory_loo: dict[str, float]          # run -> its memory error with the fit made without it
    model: str = "OPT-350"
    gpu: str = "GH-96"

    def included(self) -> list[GpuRunRow]:
        return [r for r in self.rows if r.excluded is None]

    def summary(self) -> dict[str, float]:
        rows = self.included()
        it = [abs(r.error) for r in rows]
        ea = [abs(r.earlier_error) for r in rows if r.earlier_error is not None]
        mem = [abs(r.mem_error) for r in rows]
        em = [abs(device_memory(r.predicted_alloc, self.memory_fit) - r.earlier_mem) / r.earlier_mem
              for r in rows if r.earlier_mem is not None]
        ov = [abs(r.overlapped_s - r.measured_s) / r.measured_s for r in rows if r.overlapped_s is not None]
        loo = [abs(v) for v in self.memory_loo.values()]
        return {"runs": len(rows), "iteration_mean": _mean(it), "iteration_worst": max(it),
                "earlier_iteration_mean": _mean(ea), "earlier_iteration_worst": max(ea, default=float("nan")),
                "memory_mean": _mean(mem), "memory_worst": max(mem), "memory_loo_mean": _mean(loo),
                "memory_loo_worst": max(loo, default=float("nan")), "earlier_memory_mean": _mean(em),
                "overlapped_iteration_mean": _mean(ov), "overlapped_iteration_worst": max(ov, default=float("nan")),
                "memory_base_bytes": self.memory_fit[0], "memory_reserve": self.memory_fit[1]}

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "summary": self.summary(),
                "rows": [{**asdict(r), "error": r.error, "mem_error": r.mem_error} for r in self.rows],
                "memory_fit": {"base_bytes": self.memory_fit[0], "reserve": self.memory_fit[1]},
                "memory_leave_one_out": self.memory_loo, "sailor": SAILOR}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def validate_gpu_runs(data: GpuRunData, workdir: str | Path, p2p: str = "blocking") -> GpuValidation:
    """Every run of `data` predicted (specs written under `workdir`), the memory fit made."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    models = {(r["model"], r["gpu_types"][0]) for r in data.runs}
    profiles = {key: sailor_profile(data, *key) for key in models}
    for (model, gpu), prof in profiles.items():   # what `geotrain simulate PLAN --profile FILE` reads
        (workdir / f"profile-{model}-{gpu}.json").write_text(json.dumps(prof, indent=1) + "\n")
    rows = [predict_run(data, r, profiles[(r["model"], r["gpu_types"][0])], workdir, p2p) for r in data.runs]
    kept = [r for r in rows if r.excluded is None]
    fit = fit_memory(kept)
    for r in rows:
        r.predicted_mem = device_memory(r.predicted_alloc, fit)
    loo = {}
    for r in kept:
        f = fit_memory([x for x in kept if x is not r])
        loo[r.run] = (device_memory(r.predicted_alloc, f) - r.measured_mem) / r.measured_mem
    model, gpu = sorted(models)[0]
    return GpuValidation(rows=rows, memory_fit=fit, memory_loo=loo, model=model, gpu=gpu)
