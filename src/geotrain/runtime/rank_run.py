"""One rank's run as named steps: set up, resume, train one step, log, checkpoint, finish.

`trainer.train` is the loop over these steps. Everything a rank computes with lives on its device
(`cuda:LOCAL_RANK` when CUDA is available, else the CPU).

The loss, and why no step waits for the whole world: in bf16/fp32 nothing needs a world-wide
decision, so the only collectives a step runs are the DP gradient reduction inside each stage's
DC (a region plan's: across its region's DCs, through the process group) and the loss sum over
the last stage's DP replicas. The last stage's
first rank (`report_rank`) owns the loss: it writes losses.jsonl and shows the progress. Only fp16
needs one world-wide all-reduce per step -- the overflow flag, so every rank skips the same steps
(the loss rides along in the same tensor).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from geotrain.errors import GeotrainError
from geotrain.runtime.batches import make_source
from geotrain.runtime.checkpoint import Checkpointer
from geotrain.runtime.cross_dc import build_transport, start_delay
from geotrain.runtime.meshes import stage_mesh, tp_code
from geotrain.runtime.parallelize import autocast_context, optimizer_param_groups, precision_dtype
from geotrain.runtime.recorder import Recorder
from geotrain.runtime.scaler import GlobalLossScaler, _local
from geotrain.runtime.tied import TiedCopies


def make_optimizer(params: list[torch.nn.Parameter], job, sharding: str = "replicate",
                   dp_group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """The job's optimizer; ZeRO-1 partitions its state over the stage's DP group."""
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[job.optimizer]
    if sharding == "zero1":
        # lazy: torch.distributed.optim imports FSDP1 and the tensor package (~0.7 s of every rank's
        # start-up here) and only ZeRO-1 needs it
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_group, lr=job.lr)
    return cls(params, lr=job.lr)


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only)."""
    def nbytes(t) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    opt = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the local partition's optimizer
    ostate = sum(nbytes(v) for st in opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None), "optimizer": ostate}


def _parse_hook(name: str) -> set[tuple[int, int]]:
    """Test hooks: GEOTRAIN_INJECT_INF / GEOTRAIN_FAIL_AT = "rank:step[,rank:step]" (steps 1-based)."""
    out = set()
    for part in os.environ.get(name, "").split(","):
        if ":" in part:
            r, s = part.split(":")
            out.add((int(r), int(s)))
    return out


def rank_device() -> torch.device:
    """This rank's device: its GPU (LOCAL_RANK, modulo the GPUs this host has: ranks may share one,
    e.g. two emulated DCs on one GPU) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def report_rank(plan) -> int:
    """The rank that owns the loss: the last stage's first replica (TP index 0)."""
    return plan.rank(plan.pp - 1, 0, 0)


class RankRun:
    """The state of one rank's run; see the module docstring."""

    def __init__(self, cfg, spec, plan, schedule, bubble_hook=None):
        # lazy: pydantic only when called (importers that never call it stay free of it)
        from geotrain.runtime.measured_memory import StepPeak

        self.cfg, self.spec, self.plan, job = cfg, spec, plan, spec.job
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if world != plan.num_ranks:
            raise GeotrainError(f"plan {plan.name!r} needs {plan.num_ranks} ranks (pp={plan.pp} x dp={plan.dp} "
                                f"x tp={plan.tp_label()}) but {world} were started")
        self.steps = cfg.steps or job.steps
        self.every = job.checkpoint_every if cfg.checkpoint_every is None else cfg.checkpoint_every
        self.out = Path(cfg.out)
        self.stage, self.replica, self.tp_rank = plan.coords(self.rank)
        self.device = rank_device()
        self.reporter = self.rank == report_rank(plan)
        torch.manual_seed(job.seed)
        # One (pp, dp, tp) mesh holding the plan's rank table (Plan.rank_table: stage-major, or a region
        # plan's pipeline-major numbering), so its "dp" slices are each stage's replicas whatever the
        # numbering. FSDP2 over "dp" and TP over "tp" must be slices of the same mesh to compose.
        self.mesh = stage_mesh(self.device.type, plan, self.stage)
        self.dp_group = self.mesh["dp"].get_group()
        self.schedule = schedule                # schedule_for_plan(plan), built once (trainer.resolve_run)
        self.chunks = self._build_chunks()
        self.params = [p for m in self.chunks.values() for p in m.parameters()]
        self.tied = TiedCopies(plan, spec.model, self.rank, self.chunks)
        tp = plan.stage_tp(self.stage)
        self.optimizer = make_optimizer(optimizer_param_groups(self.params) if tp > 1 else self.params, job,
                                        plan.sharding, self.dp_group)
        self.scaler = GlobalLossScaler(plan.precision == "fp16")
        self.source = make_source(spec, plan, cfg.data if cfg.data is not None else job.data, job.seed)
        self.holds_data = any(v in self.chunks for v in (0, self.schedule.num_virtual - 1))
        self.holds_loss = self.schedule.num_virtual - 1 in self.chunks
        self.recorder = Recorder(self.rank, self._common_clock(), enabled=cfg.trace,
                                 sync=torch.cuda.synchronize if self.device.type == "cuda" else None)
        self.ckpt = Checkpointer(self.out / "checkpoints", self.stage, self.replica, self.chunks, self.optimizer,
                                 self.scaler, layout=(plan.pp, plan.dp, tp_code(plan)))
        self.inject_inf = _parse_hook("GEOTRAIN_INJECT_INF") | {tuple(x) for x in cfg.inject_inf}
        self.fail_at = _parse_hook("GEOTRAIN_FAIL_AT") | {tuple(x) for x in cfg.fail_at}
        self.tokens_per_step = plan.global_batch * spec.model.seq_len
        self.start, self.step, self.optimizer_steps = 0, 0, 0
        self.loss: float | None = None          # the step's mean loss, where known (report rank; all ranks in fp16)
        self.skipped = False
        self.memory: dict[str, int] = {}
        self.resumed: dict[str, float] = {}     # wall clock of the checkpoint load (bench_elastic)
        # The peak is measured on one steady-state step: the second (optimizer state exists by then).
        self.peak = StepPeak(self.device)
        self.bubble = self._bubble_hook(bubble_hook)
        self.transport, self.runner = self._pipeline()

    # -- set-up ----------------------------------------------------------------------------
    def _build_chunks(self) -> dict[int, torch.nn.Module]:
        """This rank's chunks, built on the meta device and materialised already sharded
        (`materialize.build_chunk`): random init, or the HF checkpoint's tensors of the chunk."""
        # lazy: pydantic only when called (importers that never call it stay free of it)
        from geotrain.runtime.materialize import build_chunk

        plan, model, chunks = self.plan, self.spec.model, {}
        for c, (a, b) in enumerate(plan.stages[self.stage].chunks):
            stage_plan = plan.with_(checkpointing=plan.stage_checkpointing(self.stage))  # this stage's own mode
            chunks[c * plan.pp + self.stage] = build_chunk(model, a, b, stage_plan, self.mesh, self.device,
                                                           hf=model.hf)
        return chunks

    def _common_clock(self) -> float:
        """A common time origin: rank 0's wall clock after everyone arrived (a CPU tensor: gloo)."""
        dist.barrier()
        t0 = torch.tensor([time.time()], dtype=torch.float64)
        dist.broadcast(t0, src=0)
        return float(t0.item())

    def _bubble_hook(self, factory):
        if not self.cfg.bubbletea:
            return None
        if factory is None:
            raise GeotrainError("the run config asks for BubbleTea but no bubble hook was installed (start the "
                                "ranks with `python -m geotrain.orchestrate.rank_entry`, as `geotrain train` does)")
        # The inference model lives on this rank's device, beside training.
        return factory({**self.cfg.bubbletea, "device": str(self.device)}, self.rank, self.recorder)

    def _pipeline(self):
        # lazy: pydantic only when called (importers that never call it stay free of it)
        from geotrain.runtime.interpreter import PipelineRank

        spec, plan = self.spec, self.plan
        transport = build_transport(self.cfg.wan, spec, plan, self.schedule, self.rank, recorder=self.recorder)
        runner = PipelineRank(plan=plan, schedule=self.schedule, stage=self.stage, replica=self.replica,
                              tp_rank=self.tp_rank,
                              tp_group=self.mesh["tp"].get_group() if plan.stage_tp(self.stage) > 1 else None,
                              chunks=self.chunks, transport=transport, recorder=self.recorder,
                              autocast=autocast_context(plan.precision, self.device),
                              boundary_shape=(plan.micro_batch, spec.model.seq_len, spec.model.hidden),
                              boundary_dtype=precision_dtype(plan.precision), device=self.device,
                              dp_group=self.dp_group, on_optimizer=self._on_optimizer, bubble=self.bubble)
        return transport, runner

    def resume(self) -> int:
        """Load the latest checkpoint if asked to (this run's, or `resume_from`'s on any layout);
        the step to continue after (0: a fresh run)."""
        # lazy: pydantic only when called (importers that never call it stay free of it)
        from geotrain.layout.plan import save_plan

        cfg = self.cfg
        t_load = time.time()
        self.start, loader_state = self.ckpt.begin(
            cfg.resume, saving=bool(self.every),
            source=Path(cfg.resume_from) / "checkpoints" if cfg.resume_from else None)
        if cfg.resume or cfg.resume_from:     # wall clock of the load, for bench_elastic
            self.resumed = {"load_start": t_load, "load_end": time.time()}
        if loader_state is not None and hasattr(self.source, "load_state_dict"):
            self.source.load_state_dict(loader_state)
        if self.reporter:      # the run directory is the reporting rank's (its host's, under torchrun)
            self.out.mkdir(parents=True, exist_ok=True)
            save_plan(self.out / "plan.json", self.plan, spec=self.spec,
                      spec_path=None if cfg.spec_doc else str(Path(cfg.spec).resolve()))
        return self.start

    # -- one step --------------------------------------------------------------------------
    def fail_if_injected(self, step: int) -> None:
        if (self.rank, step) in self.fail_at:
            raise RuntimeError(f"injected failure at step {step} (GEOTRAIN_FAIL_AT)")

    def train_step(self, step: int) -> float:
        """Run the schedule once (measuring the peak memory of one steady-state step); returns the
        step's wall seconds."""
        # lazy: pydantic only when called (importers that never call it stay free of it)
        from geotrain.runtime.measured_memory import fsdp_gathered_storages, state_tensors

        self.step = self.recorder.iteration = step
        measuring = contextlib.nullcontext()
        if step == min(self.steps, self.start + 2):
            measuring = self.peak.step(state_tensors(self.chunks.values(), self.optimizer),
                                       fsdp_gathered_storages(self.chunks.values()))
        with measuring:
            batches = {}
            if self.holds_data:
                batches = {j: tuple(t.to(self.device) for t in self.source.batch(step - 1, self.replica, j))
                           for j in range(self.plan.num_microbatches)}
            self.step_start = t = time.time()
            delay = start_delay(self.plan, self.replica)   # the plan's pipeline offset: staggered DP pipelines
            if step == self.start + 1 and delay > 0:
                time.sleep(delay)
            self.runner.run_iteration(batches, loss_scale=self.scaler.scale)
            seconds = time.time() - t
            del batches
        return seconds

    def _on_optimizer(self, loss_local: float) -> None:
        """At the schedule's OPTIMIZER action: the overflow decision (fp16 only), the step, the loss."""
        rec, plan = self.recorder, self.plan
        if (self.rank, self.step) in self.inject_inf:
            g = next(p.grad for p in self.params if p.grad is not None and _local(p.grad).numel())
            _local(g).view(-1)[0] = float("inf")
        self.tied.sum_grads()             # tied embeddings: the first and last stage's copies stay equal
        t1 = rec.now()
        skipped, loss = False, None
        if self.scaler.enabled:    # fp16: every rank must skip the same steps -- the one world-wide collective
            found = self.scaler.local_found_inf(self.params)
            stats = torch.tensor([1.0 if found else 0.0, loss_local], dtype=torch.float64)
            dist.all_reduce(stats)
            rec.add("recv_wait", t1, rec.now(), stage=-1)
            # Every TP rank of the last stage holds the same (full-logit) loss: count each replica once.
            skipped, loss = bool(stats[0] > 0), float(stats[1]) / (plan.dp * plan.stage_tp(plan.pp - 1))
        t2 = rec.now()
        if not skipped:
            self.optimizer.step()
            self.optimizer_steps += 1
            if self.optimizer_steps == 1:
                self.memory = state_bytes(self.params, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.update(skipped)
        rec.add("optimizer", t2, rec.now(), stage=min(self.chunks))
        if loss is None and self.holds_loss:   # bf16/fp32: the last stage's replicas sum it, inside their DC
            t = torch.tensor([loss_local], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=self.dp_group)
            loss = float(t) / plan.dp
        self.loss, self.skipped = loss, skipped

    def checkpoint_if_due(self, step: int) -> None:
        if self.every and (step % self.every == 0 or step == self.steps):
            state = self.source.state_dict() if hasattr(self.source, "state_dict") else None
            self.ckpt.save(step, state)

    # -- the end ---------------------------------------------------------------------------
    def close_transport(self) -> None:
        if hasattr(self.transport, "close"):
            self.transport.close()      # peers see the connections drop instead of waiting for a timeout

    def close_hooks(self) -> None:
        if self.bubble is not None:
            self.bubble.close()

    def finish(self, wall: float, losses: list[dict] | None = None) -> dict[str, Any]:
        """The run's outputs (`summary.write_outputs`); `losses`: the loss rows as written (LossLog.rows)."""
        # lazy: pydantic only when called (importers that never call it stay free of it)
        from geotrain.runtime.outputs import write_outputs

        result = write_outputs(self.cfg, self.spec, self.plan, self.schedule, self.recorder, self.out, wall=wall,
                               steps_run=self.steps - self.start, tokens_per_step=self.tokens_per_step,
                               optimizer_steps=self.optimizer_steps, memory={**self.memory, "peak": self.peak.bytes},
                               reporter=report_rank(self.plan), losses=losses or [])
        if hasattr(self.transport, "close"):
            dist.barrier()             # every rank's last transfer (and turn) is done before any closes
            self.transport.close()
        return result




class LossLog:
    """losses.jsonl and the progress display, on the rank that owns the loss (`report_rank`)."""

    def __init__(self, run: RankRun, start: int):
        self.run = run
        self.bar = None
        self.file = None
        self.rows: list[dict] = []          # what losses.jsonl holds, kept for the summary (no read-back)
        if not run.reporter:
            return
        run.out.mkdir(parents=True, exist_ok=True)
        source = Path(run.cfg.resume_from) if run.cfg.resume_from else None
        if source is not None and source.resolve() != run.out.resolve():
            self.rows = _carry_losses(source / "losses.jsonl", run.out / "losses.jsonl", start)
        else:
            self.rows = _trim_losses(run.out / "losses.jsonl", start)
        self.file = open(run.out / "losses.jsonl", "a")  # noqa: SIM115 -- closed in close()
        if run.cfg.progress:
            if sys.stdout.isatty():
                self.bar = tqdm(total=run.steps, initial=start, desc="train", unit="step", file=sys.stdout,
                                dynamic_ncols=True)
            else:
                self.bar = _LineProgress(run.steps, start)

    def record(self, step: int, seconds: float) -> None:
        run = self.run
        if self.file is not None:
            row = {"step": step, "loss": run.loss, "skipped": run.skipped, "loss_scale": run.scaler.scale,
                   "step_time_s": seconds, "tokens": run.tokens_per_step, "time": time.time() - run.recorder.t0,
                   "wall": time.time()}
            if run.bubble is not None:
                row["prefill"] = run.bubble.filling()      # BubbleTea was filling bubbles in this step
            if step == run.start + 1 and run.cfg.resume_from:
                plan = run.plan
                row["resumed_from"] = str(run.cfg.resume_from)   # the curve continues on a new layout here
                row["layout"] = {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp, "sharding": plan.sharding}
                row["resume_wall"] = {**run.resumed, "step_start": run.step_start, "step_end": time.time()}
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            self.rows.append(row)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{run.loss:.4f}", tok_s=f"{run.tokens_per_step / seconds:,.0f}",
                                 **({"skipped": "yes"} if run.skipped else {}))
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


class _LineProgress:
    """Progress for logs and pipes: one plain line every tenth of the run, where tqdm's
    carriage-return redraws would pile up into one unreadable line."""

    def __init__(self, total: int, initial: int = 0):
        self.total, self.n, self.every = total, initial, max(1, total // 10)
        self.first, self.t0, self.postfix = initial, time.time(), {}

    def set_postfix(self, **kw: str) -> None:
        self.postfix = kw

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.n % self.every == 0 or self.n == self.total:
            extra = "  ".join(f"{key} {val}" for key, val in self.postfix.items())
            took = time.time() - self.t0
            eta = took / max(1, self.n - self.first) * (self.total - self.n)
            print(f"train step {self.n}/{self.total}  {extra}  ({took:.1f} s, ETA {eta:.0f} s)", flush=True)

    def close(self) -> None:
        pass


def _trim_losses(path: Path, start: int) -> list[dict]:
    """On resume, drop loss lines past the checkpoint (they are recomputed); fresh run: start empty.
    Returns the rows kept."""
    if start == 0 or not path.exists():
        path.write_text("")
        return []
    return _keep_losses(path.read_text().splitlines(), path, start)


def _carry_losses(source: Path, path: Path, start: int) -> list[dict]:
    """Resumed from another run: its loss lines up to the checkpoint open this run's curve."""
    return _keep_losses(source.read_text().splitlines() if source.exists() else [], path, start)


def _keep_losses(lines: list[str], path: Path, start: int) -> list[dict]:
    """Write to `path` the loss lines up to step `start`; returns them parsed."""
    keep = [(line, json.loads(line)) for line in lines if line.strip()]
    keep = [(line, row) for line, row in keep if row["step"] <= start]
    path.write_text("".join(line + "\n" for line, _ in keep))
    return [row for _, row in keep]
