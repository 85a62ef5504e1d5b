"""One rank's training run: build its stage from the plan, execute the schedule, record, checkpoint.

Called on every rank of an initialized process group (by `worker.py`, under our launcher or
torchrun). Ranks are stage-major with TP innermost (`plan.rank(stage, replica, t)`), so the
(pp, dp, tp) device mesh built here has one DP group per stage and TP index, inside the stage's DC,
and one TP group of consecutive ranks (inside a node) per stage replica.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.errors import GeotrainError

# (conf, rank, recorder) -> an object with fill(...)/filling()/close(), or None; see PipelineRank's `bubble`.
BubbleHookFactory = Callable[[dict[str, Any], int, Any], Any]


@dataclass
class RunConfig:
    """What to run. JSON-serializable: the launcher hands it to every rank in a file."""

    spec: str                                   # experiment TOML (or the plan file spec_doc came from)
    spec_doc: dict[str, Any] | None = None      # the experiment itself (config.document), as plan files carry it
    out: str = "runs/latest"
    plan: dict[str, Any] | None = None          # Plan.to_dict(); None: the plan the job pins
    overrides: dict[str, Any] = field(default_factory=dict)   # Plan fields to replace
    steps: int | None = None                    # None: job.steps
    resume: bool = False
    resume_from: str | None = None              # another run's RUN_DIR: start from its latest checkpoint, resharded
    checkpoint_every: int | None = None         # None: job.checkpoint_every
    data: str | None = None                     # None: job.data, then the built-in corpus
    progress: bool = True
    trace: bool = True
    # Test hooks, [[rank, step], ...] (steps 1-based); also settable by env GEOTRAIN_INJECT_INF /
    # GEOTRAIN_FAIL_AT = "rank:step,...". inject_inf puts an inf into one gradient of that rank
    # before the overflow check; fail_at raises on that rank at the start of that step.
    inject_inf: list[list[int]] = field(default_factory=list)
    fail_at: list[list[int]] = field(default_factory=list)
    # BubbleTea: prefill requests from the service at `address` run in this rank's bubbles
    # ({"address": [host, port], "inference_model": ..., ...}; see bubbletea.runtime_hook).
    bubbletea: dict[str, Any] | None = None
    # The WAN between the plan's DCs (set by the launcher, see runtime.wan): {"mode": "kernel"|"shaper",
    # "rate_scale", "timeout_s", "hosts": {dc: address}}. None: gloo for every pair (no emulated WAN).
    wan: dict[str, Any] | None = None


def make_optimizer(params: list[torch.nn.Parameter], job, sharding: str = "replicate",
                   dp_group: dist.ProcessGroup | None = None) -> torch.optim.Optimizer:
    """The job's optimizer; ZeRO-1 partitions its state over the stage's DP group."""
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[job.optimizer]
    if sharding == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=dp_group, lr=job.lr)
    return cls(params, lr=job.lr)


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards only)."""
    from geotrain.runtime.scaler import _local

    def nbytes(t) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    opt = getattr(optimizer, "optim", optimizer)  # ZeRO-1: the local partition's optimizer
    ostate = sum(nbytes(v) for st in opt.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None), "optimizer": ostate}


def resolve(cfg: RunConfig):
    """(spec, plan) for a run config, with user errors as GeotrainError."""
    from geotrain.config import load_spec, spec_from_document
    from geotrain.plan.manual import plan_from_job
    from geotrain.plan.plan import Plan

    spec = spec_from_document(cfg.spec_doc, cfg.spec) if cfg.spec_doc else load_spec(cfg.spec)
    plan = Plan.from_dict(cfg.plan) if cfg.plan else plan_from_job(spec)
    if cfg.overrides:
        plan = plan.with_(**cfg.overrides)
    from geotrain.runtime.parallelize import tp_problem

    problem = tp_problem(spec.model, plan, spec.cluster)
    if problem:
        raise GeotrainError(f"plan {plan.name!r}: {problem}")
    if plan.tp > 1 and plan.sharding == "zero1":
        raise GeotrainError(f"plan {plan.name!r}: sharding zero1 is not supported with tp={plan.tp} "
                            "(use replicate, zero2 or zero3)")
    if plan.num_microbatches < 1 or plan.micro_batch < 1:
        raise GeotrainError("the plan needs at least one micro-batch of at least one sequence")
    schedule = _build_schedule(plan)  # a schedule the builders refuse is a user error, found before any rank starts
    if plan.checkpointing == "selective" and _splits_backward(schedule):
        raise GeotrainError(f"plan {plan.name!r}: selective checkpointing cannot run under the {plan.schedule} "
                            "schedule's split backward (PyTorch allows one backward through a selectively "
                            "checkpointed region); use checkpointing full or none")
    return spec, plan


def _splits_backward(schedule) -> bool:
    """Whether the schedule runs a stage's backward as two autograd passes (input, then weights)."""
    from geotrain.schedule.actions import Op

    return any(a.op == Op.BACKWARD_INPUT for actions in schedule.actions for a in actions)


def _build_schedule(plan):
    from geotrain.schedule.builders import schedule_for_plan

    return schedule_for_plan(plan)


def _parse_hook(name: str) -> set[tuple[int, int]]:
    """Test hooks: GEOTRAIN_INJECT_INF / GEOTRAIN_FAIL_AT = "rank:step[,rank:step]" (steps 1-based)."""
    out = set()
    for part in os.environ.get(name, "").split(","):
        if ":" in part:
            r, s = part.split(":")
            out.add((int(r), int(s)))
    return out


def train(cfg: RunConfig, bubble_hook: BubbleHookFactory | None = None) -> dict[str, Any]:
    """Train on this rank. Returns a small result dict (losses on rank 0).

    `bubble_hook(conf, rank, recorder)` builds what runs in this rank's pipeline bubbles when
    `cfg.bubbletea` is set; the caller installs it (`orchestrate.rank` installs BubbleTea's), so the
    runtime never imports what plugs into it."""
    from torch.distributed.device_mesh import init_device_mesh

    from geotrain.models.llama import build_units
    from geotrain.plan.plan import save_plan
    from geotrain.runtime.checkpoint import Checkpointer
    from geotrain.runtime.checkpointing import apply_checkpointing
    from geotrain.runtime.memory import StepPeak, fsdp_gathered_storages, state_tensors
    from geotrain.runtime.parallelize import (
        apply_fsdp,
        apply_tp,
        autocast_context,
        optimizer_param_groups,
        precision_dtype,
    )
    from geotrain.runtime.pipeline import PipelineRank
    from geotrain.runtime.recorder import Recorder
    from geotrain.runtime.scaler import GlobalLossScaler, _local
    from geotrain.runtime.summary import write_outputs
    from geotrain.runtime.wan import build_transport, start_delay

    spec, plan = resolve(cfg)
    job = spec.job
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.num_ranks:
        raise GeotrainError(f"plan {plan.name!r} needs {plan.num_ranks} ranks (pp={plan.pp} x dp={plan.dp} "
                            f"x tp={plan.tp}) but {world} were started")
    steps = cfg.steps or job.steps
    every = job.checkpoint_every if cfg.checkpoint_every is None else cfg.checkpoint_every
    out = Path(cfg.out)
    stage, replica, tp_rank = plan.coords(rank)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch.manual_seed(job.seed)

    # One (pp, dp, tp) mesh: its row-major layout is the plan's rank numbering. FSDP2 over "dp" and
    # TP over "tp" must be slices of the same mesh to compose.
    mesh = init_device_mesh(device.type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_mesh = mesh["dp"]
    dp_group = dp_mesh.get_group()
    schedule = _build_schedule(plan)

    chunks = {}
    for c, (a, b) in enumerate(plan.stages[stage].chunks):
        module = build_units(spec.model, a, b).to(device)
        if plan.tp > 1:
            apply_tp(module, mesh["tp"])
        apply_checkpointing(module, plan.checkpointing)
        if plan.sharding in ("zero2", "zero3"):
            apply_fsdp(module, dp_mesh, plan.sharding)
        if spec.model.hf:      # start from HF weights: this chunk's tensors only, into its own shards
            from geotrain.models.hf import load_hf_weights

            load_hf_weights(module, spec.model.hf, spec.model.layers, spec.model.tie_embeddings)
        chunks[c * plan.pp + stage] = module
    params = [p for m in chunks.values() for p in m.parameters()]
    optimizer = make_optimizer(optimizer_param_groups(params) if plan.tp > 1 else params, job, plan.sharding,
                               dp_group)
    scaler = GlobalLossScaler(plan.precision == "fp16")
    from geotrain.runtime.batches import make_source

    source = make_source(spec, plan, cfg.data if cfg.data is not None else job.data, job.seed)

    # A common time origin: rank 0's wall clock after everyone arrived.
    dist.barrier()
    t0 = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t0, src=0)
    recorder = Recorder(rank, float(t0.item()), enabled=cfg.trace)

    ckpt = Checkpointer(out / "checkpoints", stage, replica, chunks, optimizer, scaler,
                        layout=(plan.pp, plan.dp, plan.tp))
    t_load = time.time()
    start, loader_state = ckpt.begin(cfg.resume, saving=bool(every),
                                     source=Path(cfg.resume_from) / "checkpoints" if cfg.resume_from else None)
    # wall clock of the load, for bench_elastic
    resumed = {"load_start": t_load, "load_end": time.time()} if (cfg.resume or cfg.resume_from) else {}
    if loader_state is not None and hasattr(source, "load_state_dict"):
        source.load_state_dict(loader_state)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_plan(out / "plan.json", plan, spec_path=None if cfg.spec_doc else str(Path(cfg.spec).resolve()), spec=spec)
        if cfg.resume_from and Path(cfg.resume_from).resolve() != out.resolve():
            _carry_losses(Path(cfg.resume_from) / "losses.jsonl", out / "losses.jsonl", start)
        else:
            _trim_losses(out / "losses.jsonl", start)

    inject_inf = _parse_hook("GEOTRAIN_INJECT_INF") | {tuple(x) for x in cfg.inject_inf}
    fail_at = _parse_hook("GEOTRAIN_FAIL_AT") | {tuple(x) for x in cfg.fail_at}
    holds_data = any(v in chunks for v in (0, schedule.num_virtual - 1))
    tokens_per_step = plan.global_batch * spec.model.seq_len
    state = {"step": start, "loss": 0.0, "skipped": False, "optimizer_steps": 0}

    def on_optimizer(loss_local: float) -> None:
        step = state["step"]
        if (rank, step) in inject_inf:
            g = next(p.grad for p in params if p.grad is not None and _local(p.grad).numel())
            _local(g).view(-1)[0] = float("inf")
        t1 = recorder.now()
        found = scaler.local_found_inf(params)
        stats = torch.tensor([1.0 if found else 0.0, loss_local], dtype=torch.float64)
        dist.all_reduce(stats)
        t2 = recorder.now()
        recorder.add("recv_wait", t1, t2, stage=-1)      # everyone agrees on overflow and loss
        skipped = bool(stats[0] > 0)
        if not skipped:
            optimizer.step()
            state["optimizer_steps"] += 1
            if state["optimizer_steps"] == 1:
                state["memory"] = state_bytes(params, optimizer)
        optimizer.zero_grad(set_to_none=True)
        scaler.update(skipped)
        recorder.add("optimizer", t2, recorder.now(), stage=min(chunks))
        # Every TP rank of the last stage holds the same (full-logit) loss: count each replica once.
        state["loss"], state["skipped"] = float(stats[1]) / (plan.dp * plan.tp), skipped

    bubble = None
    if cfg.bubbletea:
        if bubble_hook is None:
            raise GeotrainError("the run config asks for BubbleTea but no bubble hook was installed (start the "
                                "ranks with `python -m geotrain.orchestrate.rank`, as `geotrain train` does)")
        bubble = bubble_hook(cfg.bubbletea, rank, recorder)
    boundary = (plan.micro_batch, spec.model.seq_len, spec.model.hidden)
    transport = build_transport(cfg.wan, spec, plan, schedule, rank)
    first_delay = start_delay(plan, replica)     # the plan's pipeline offset: staggered DP pipelines
    runner = PipelineRank(plan=plan, schedule=schedule, stage=stage, replica=replica, tp_rank=tp_rank, chunks=chunks,
                          transport=transport, recorder=recorder,
                          autocast=autocast_context(plan.precision, device), boundary_shape=boundary,
                          boundary_dtype=precision_dtype(plan.precision),
                          dp_group=dp_group, on_optimizer=on_optimizer, bubble=bubble)

    bar = None
    if rank == 0 and cfg.progress:
        if sys.stdout.isatty():
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=start, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True)
        else:
            bar = _LineProgress(steps, start)
    losses_file = open(out / "losses.jsonl", "a") if rank == 0 else None  # noqa: SIM115 -- closed below
    # The peak is measured on one steady-state step: the second (optimizer state exists by then).
    peak, peak_step = StepPeak(device), min(steps, start + 2)
    run_start = time.time()
    try:
        for step in range(start + 1, steps + 1):
            if (rank, step) in fail_at:
                raise RuntimeError(f"injected failure at step {step} (GEOTRAIN_FAIL_AT)")
            state["step"] = step
            recorder.iteration = step
            measuring = contextlib.nullcontext()
            if step == peak_step:
                measuring = peak.step(state_tensors(chunks.values(), optimizer),
                                      fsdp_gathered_storages(chunks.values()))
            with measuring:
                batches = {}
                if holds_data:
                    batches = {j: tuple(t.to(device) for t in source.batch(step - 1, replica, j))
                               for j in range(plan.num_microbatches)}
                t_step = time.time()
                if step == start + 1 and first_delay > 0:
                    time.sleep(first_delay)
                runner.run_iteration(batches, loss_scale=scaler.scale)
                dt = time.time() - t_step
                del batches
            if losses_file is not None:
                row = {"step": step, "loss": state["loss"], "skipped": state["skipped"], "loss_scale": scaler.scale,
                       "step_time_s": dt, "tokens": tokens_per_step, "time": time.time() - recorder.t0,
                       "wall": time.time()}
                if bubble is not None:
                    row["prefill"] = bubble.filling()      # BubbleTea was filling bubbles in this step
                if step == start + 1 and cfg.resume_from:
                    row["resumed_from"] = str(cfg.resume_from)   # the curve continues on a new layout here
                    row["layout"] = {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp, "sharding": plan.sharding}
                    row["resume_wall"] = {**resumed, "step_start": t_step, "step_end": time.time()}
                losses_file.write(json.dumps(row) + "\n")
                losses_file.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{state['loss']:.4f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                                **({"skipped": "yes"} if state["skipped"] else {}))
                bar.update(1)
            if every and (step % every == 0 or step == steps):
                loader_state = source.state_dict() if hasattr(source, "state_dict") else None
                ckpt.save(step, loader_state)
    except BaseException:
        if hasattr(transport, "close"):
            transport.close()      # peers see the connections drop instead of waiting for a timeout
        raise
    finally:
        if bubble is not None:
            bubble.close()
        if bar is not None:
            bar.close()
        if losses_file is not None:
            losses_file.close()
    wall = time.time() - run_start
    result = write_outputs(cfg, spec, plan, recorder, out, wall=wall, steps_run=steps - start,
                           tokens_per_step=tokens_per_step, optimizer_steps=state["optimizer_steps"],
                           memory={**state.get("memory", {}), "peak": peak.bytes})
    if hasattr(transport, "close"):
        dist.barrier()             # every rank's last transfer (and turn) is done before any closes
        transport.close()
    return result


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


def _trim_losses(path: Path, start: int) -> None:
    """On resume, drop loss lines past the checkpoint (they are recomputed); fresh run: start empty."""
    if start == 0 or not path.exists():
        path.write_text("")
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= start]
    path.write_text("".join(line + "\n" for line in keep))


def _carry_losses(source: Path, path: Path, start: int) -> None:
    """Resumed from another run: its loss lines up to the checkpoint open this run's curve."""
    lines = source.read_text().splitlines() if source.exists() else []
    keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= start]
    path.write_text("".join(line + "\n" for line in keep))
