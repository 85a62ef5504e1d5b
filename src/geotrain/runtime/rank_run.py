"""One rank's training run: build its parts, resume, train step by step, checkpoint, write outputs.

Called on every rank of an initialized process group (by `worker.py`, under our launcher or
torchrun). The parts, one job each: `rank_model` (mesh and chunks), `batches.RankBatches` (the
data), `trainer.Trainer` (the step), `loss_log.LossLog` (losses.jsonl, progress), `checkpoint`
(DCP saves), `outputs` (trace and summary). Everything a rank computes with lives on its device
(`cuda:LOCAL_RANK` when CUDA is available, else the CPU).

Why no step waits for the whole world: in bf16/fp32 the only collectives a step runs are the DP
gradient reduction inside each stage's DC (a region plan's: across its region's DCs) and the loss
sum over the last stage's DP replicas; only fp16 needs one world-wide all-reduce per step, the
overflow flag (`trainer.StepGroup`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from geotrain.emulation.fallback import fallback_shaper
from geotrain.emulation.ports import spread_port_connections
from geotrain.errors import GeotrainError
from geotrain.layout.plan import save_plan
from geotrain.runtime import p2p as T
from geotrain.runtime.batches import RankBatches, make_source, write_data_report
from geotrain.runtime.checkpoint import Checkpointer
from geotrain.runtime.compress import CompressedTransport
from geotrain.runtime.cross_dc import (
    DEFAULT_STALL_S,
    MIN_CHUNK_BYTES,
    RANK_MODES,
    RecordedTurns,
    cross_dc_links,
    start_delay,
    turn_order,
)
from geotrain.runtime.diloco_setup import build_diloco
from geotrain.runtime.interpreter import PipelineRank
from geotrain.runtime.loss_log import LossLog
from geotrain.runtime.measured_memory import StepPeak, fsdp_gathered_storages, state_tensors
from geotrain.runtime.meshes import tp_code
from geotrain.runtime.outputs import write_outputs
from geotrain.runtime.parallelize import autocast_context, precision_dtype
from geotrain.runtime.rank_model import RankModel, build_rank_model
from geotrain.runtime.recipe import GradNorm, param_groups
from geotrain.runtime.recorder import Recorder
from geotrain.runtime.scaler import GlobalLossScaler
from geotrain.runtime.train_config import RunCase, TrainConfig, WanConfig, report_rank
from geotrain.runtime.trainer import StepGroup, Trainer, make_optimizer
from geotrain.torch_compat import default_store
from geotrain.transport.auth import run_secret
from geotrain.transport.striped import StripedTransport
from geotrain.transport.turns import link_handoff, turn_slots, turns_via_store

# (conf, rank, recorder) -> an object with fill(...)/filling()/close(), or None; see PipelineRank's `bubble`.
BubbleHookFactory = Callable[[dict[str, Any], int, Any], Any]

# The attribute `run_rank` sets on the exception a rank fails with: time.time() when it failed.
FAILED_AT = "geotrain_failed_at"


def common_clock() -> float:
    """A common time origin: rank 0's wall clock after everyone arrived (a CPU tensor: gloo)."""
    dist.barrier()
    t0 = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t0, src=0)
    return float(t0.item())


def _bubble(cfg: TrainConfig, factory, me: RankModel, recorder: Recorder):
    """What runs in this rank's pipeline bubbles (BubbleTea), or None."""
    serve = cfg.serve
    if serve is None:
        return None
    if factory is None:
        raise GeotrainError("the run config asks for BubbleTea but no bubble hook was installed (start the "
                            "ranks with `python -m geotrain.orchestrate.rank_entry`, as `geotrain train` does)")
    conf = {"address": serve.address, "secret_file": serve.secret_file, "inference_model": serve.model,
            "priority": None if serve.priority == "auto" else serve.priority, "duty": serve.duty,
            "device": str(me.device)}      # the inference model lives on this rank's device, beside training
    return factory(conf, me.rank, recorder)


def _build_trainer(case: RunCase, me: RankModel, optimizer, scaler, recorder, bubble):
    """The pipeline interpreter over this rank's transport, and the Trainer stepping it."""
    cfg, spec, plan, schedule = case.config, case.spec, case.plan, case.schedule
    transport = build_transport(cfg.wan, spec, plan, schedule, me.rank, recorder=recorder, staged_peers=me.shared.peers)
    runner = PipelineRank(plan=plan, schedule=schedule, stage=me.stage, replica=me.replica, tp_rank=me.tp_rank,
                          tp_group=me.tp_group(plan), chunks=me.chunks, transport=transport, recorder=recorder,
                          autocast=autocast_context(plan.precision, me.device),
                          boundary_shape=(plan.micro_batch, spec.model.seq_len, spec.model.hidden),
                          boundary_dtype=precision_dtype(plan.precision), device=me.device,
                          dp_group=me.dp_group, dp_staged=me.shared.dp, bubble=bubble)
    group = StepGroup(dp_group=me.dp_group, dp=plan.dp, loss_copies=plan.dp * plan.stage_tp(plan.pp - 1),
                      holds_loss=schedule.num_virtual - 1 in me.chunks,
                      device=torch.device("cpu") if me.shared.dp else me.device)   # sharing a GPU: sum over gloo
    # The gradient norm's exchange (clipping on, bf16/fp32: fp16 folds it into its overflow all-reduce).
    norm = GradNorm(plan, me.rank, me.device, cfg.wan.outage_limit_s) \
        if spec.job.grad_clip > 0 and plan.precision != "fp16" else None
    trainer = Trainer(runner, me.params, optimizer, scaler, tied=me.tied, group=group, recorder=recorder,
                      stage=min(me.chunks), inject_inf=cfg.hooks.steps("inject_inf", me.rank), job=spec.job,
                      norm=norm, norm_skip=me.tied.head_copy)   # counted with the embedding
    return transport, trainer


def run_rank(case: RunCase, bubble_hook: BubbleHookFactory | None = None) -> dict[str, Any]:
    """Train `case` on this rank (an initialized process group). Returns the run's outputs on the rank
    that owns the loss (`outputs.write_outputs`: losses, summary, trace), {} elsewhere.

    `bubble_hook(conf, rank, recorder)` builds what runs in this rank's pipeline bubbles when
    `config.serve` is set; the caller installs it (`orchestrate.rank_entry` installs BubbleTea's), so the
    runtime never imports what plugs into it."""
    cfg, spec, plan, schedule = case.config, case.spec, case.plan, case.schedule
    job, out = spec.job, Path(cfg.out)
    steps, every = cfg.run_steps(spec), cfg.saving_every(spec)
    me = build_rank_model(spec, plan)
    optimizer = make_optimizer(param_groups(me.chunks.values(), job, embeddings=me.tied.params), job,
                               plan.sharding, me.dp_group)
    scaler = GlobalLossScaler(plan.precision == "fp16")
    data = RankBatches(make_source(spec, plan, cfg.data if cfg.data is not None else job.data, job.seed),
                       plan.worker * plan.dp + me.replica, plan.num_microbatches, me.device,
                       needed=any(v in me.chunks for v in (0, schedule.num_virtual - 1)))
    recorder = Recorder(me.rank, common_clock(), enabled=cfg.trace, path=out / "trace" / f"rank{me.rank}.jsonl",
                        device=me.device)     # streams to this host's RUN_DIR/trace (outputs merges)
    outer = build_diloco(cfg, spec, plan, me, recorder)      # DiLoCo's outer loop (None: no workers)
    ckpt = Checkpointer(out / "checkpoints", me.stage, me.replica, me.chunks, optimizer, scaler,
                        layout=(plan.pp, plan.dp, tp_code(plan)), outer=outer)
    fail_at = cfg.hooks.steps("fail_at", me.rank)
    peak = StepPeak(me.device)     # measured on one steady-state step: the second (optimizer state exists)
    bubble = _bubble(cfg, bubble_hook, me, recorder)
    transport, trainer = _build_trainer(case, me, optimizer, scaler, recorder, bubble)
    start, resumed = _resume(case, ckpt, data, every, me.rank == report_rank(plan))
    if outer is not None and outer.joining:
        start = outer.join()      # a restarted DiLoCo worker: the others' state, and the step they reached
    if me.rank == report_rank(plan):
        write_data_report(data.source, out, steps, show=cfg.progress)
    tokens_per_step = plan.inner_plan().global_batch * spec.model.seq_len     # this worker's
    from_run = Path(cfg.resume.from_run) if cfg.resume.from_run else None
    log = LossLog(out, me.rank == report_rank(plan), steps, start, tokens_per_step, recorder.t0,
                  progress=cfg.progress, resume_from=from_run, nan_policy=spec.job.nan_policy)
    run_start = time.time()
    try:
        for step in range(start + 1, steps + 1):
            if step in fail_at:
                raise RuntimeError(f"injected failure at step {step} (hooks.fail_at)")
            recorder.iteration = step
            measuring = contextlib.nullcontext()
            if step == min(steps, start + 2):
                measuring = peak.step(state_tensors(me.chunks.values(), optimizer),
                                      fsdp_gathered_storages(me.chunks.values()))
            with measuring:
                batches = data.for_step(step)
                step_start = time.time()
                delay = start_delay(plan, me.replica)   # the plan's pipeline offset: staggered DP pipelines
                if step == start + 1 and delay > 0:
                    time.sleep(delay)
                result = trainer.step(step, batches)
                seconds = time.time() - step_start
                del batches
            if outer is not None:      # DiLoCo's outer loop: exchanges and outer steps after this inner step
                outer.after_step(step)
            extra: dict[str, Any] = {}
            if job.eval_every and (step % job.eval_every == 0 or step == steps):
                extra.update(_evaluate(trainer, data, job.eval_batches))
            if bubble is not None:
                extra["prefill"] = bubble.filling()      # BubbleTea was filling bubbles in this step
            if step == start + 1 and from_run:    # the curve continues on a new layout here
                extra.update(resumed_from=str(from_run),
                             layout={"pp": plan.pp, "dp": plan.dp, "tp": plan.tp, "sharding": plan.sharding},
                             resume_wall={**resumed, "step_start": step_start, "step_end": time.time()})
            log.record(step, result.loss, result.skipped, scaler.scale, seconds, lr=result.lr,
                       grad_norm=result.grad_norm, **extra)
            if every and (step % every == 0 or step == steps):
                if outer is not None:
                    outer.settle()
                ckpt.save(step, data.state_dict())
        if outer is not None:
            outer.finish()     # an exchange still overlapping the last steps: applied (not saved: resume exact)
    except BaseException as e:
        # When this rank failed, stamped before closing its transport makes its peers fail in turn:
        # the launcher names the earliest failure (worker.write_error), and the peers' "closed its
        # transport" errors must not come out earlier than their cause.
        if not hasattr(e, FAILED_AT):
            setattr(e, FAILED_AT, time.time())
        if hasattr(transport, "close"):
            transport.close()      # peers see the connections drop instead of waiting for a timeout
        raise
    finally:
        if bubble is not None:
            bubble.close()
        if outer is not None:
            outer.close()
        log.close()
    result = write_outputs(cfg, spec, plan, schedule, recorder, out, wall=time.time() - run_start,
                           steps_run=steps - start, tokens_per_step=tokens_per_step,
                           optimizer_steps=trainer.optimizer_steps, memory={**trainer.memory, "peak": peak.bytes},
                           reporter=report_rank(plan), losses=log.rows)
    if hasattr(transport, "close"):
        dist.barrier()             # every rank's last transfer (and turn) is done before any closes
        transport.close()
    return result


def _evaluate(trainer: Trainer, data: RankBatches, batches: int) -> dict[str, Any]:
    """The held-out loss and perplexity over the first `batches` held-out global batches (the same
    ones at every evaluation, so the curve compares like with like)."""
    losses = [trainer.evaluate(data.for_eval(k)) for k in range(batches)]
    if any(x is None for x in losses):
        return {}
    loss = sum(losses) / len(losses)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)) if math.isfinite(loss) else None}


def _resume(case: RunCase, ckpt: Checkpointer, data: RankBatches, every: int, reporter: bool):
    """Load the latest checkpoint if asked to (this run's, or `resume.from_run`'s on any layout); write
    the run's plan.json. Returns (the step to continue after -- 0: a fresh run --, the load's wall clock)."""
    resume, out = case.config.resume, Path(case.config.out)
    t_load = time.time()
    start, loader_state = ckpt.begin(resume.own, saving=bool(every),
                                     source=Path(resume.from_run) / "checkpoints" if resume.from_run else None)
    resumed = {"load_start": t_load, "load_end": time.time()} if resume.any else {}
    data.load_state_dict(loader_state)
    if reporter:      # the run directory is the reporting rank's (its host's, under torchrun)
        for line in ckpt.notes:                   # a resume that fell back to an older checkpoint: on the console
            print(line, flush=True)
        out.mkdir(parents=True, exist_ok=True)
        save_plan(out / "plan.json", case.plan, spec=case.spec)
    return start, resumed


# ----------------------------------------------------------------------------- the rank's transport
_BUILT = [0]     # transports built by this process: a fresh store namespace per run (cases share the store)


def build_transport(wan: WanConfig | None, spec, plan, schedule, rank: int,
                    p2p_groups: dict | None = None, recorder=None, staged_peers=frozenset()):
    """The transport for this rank: plain gloo/NCCL without a WAN config; else a RoutedTransport with
    StripedTransport on the cross-DC peers (runtime.cross_dc's docstring). p2p_groups: the per-direction
    process groups (default: `p2p.directed_groups`, a collective every rank enters);
    recorder: where the temporal turns taken are recorded (`RecordedTurns`); staged_peers: peers on
    this rank's own GPU, reached through host memory over gloo (NCCL refuses them: `shared_gpu`)."""

    _BUILT[0] += 1
    if p2p_groups is None:
        p2p_groups = T.directed_groups(plan, schedule)      # collective: every rank, same order
    plain = T.TorchTransport(groups=p2p_groups)
    # Always routed (every rank then has close(), so every rank enters the closing barrier alike).
    default = T.RoutedTransport(plain, dict.fromkeys(staged_peers, T.HostStaging(plain)))
    stage, replica, t = plan.coords(rank)
    links = cross_dc_links(plan, schedule, stage, replica)
    if wan is None or wan.mode == "off":
        for peer_stage in links:
            print(f"geotrain wan: rank {rank} ({plan.dc_of(stage, replica)}) -> stage {peer_stage} "
                  f"({plan.dc_of(peer_stage, replica)}): TorchTransport (plain {dist.get_backend()} across the WAN: "
                  "--wan off)", file=sys.stderr, flush=True)
        return default
    if wan.mode not in RANK_MODES:
        raise GeotrainError(f"wan mode {wan.mode!r} is not one of {', '.join(RANK_MODES)}")
    if not links:
        # Still a RoutedTransport: the trainer enters its closing barrier on ranks whose transport has
        # close(), so every rank of a WAN run must have one (pp=4 over two DCs: stages 0 and 3 have no
        # cross-DC peer, and skipping the barrier there made ranks 1 and 2 lose their gloo peers).
        return T.RoutedTransport(default)

    store = default_store()
    run = f"geotrain/rt{_BUILT[0]}"
    my_dc = plan.dc_of(stage, replica)
    host = wan.hosts[my_dc] if wan.mode == "kernel" else wan.bind or "127.0.0.1"
    timeout = wan.outage_limit_s
    secret = run_secret(store)     # the launcher's 0600 file, else shared through the store
    conns: dict[int, int] = {}
    turns: dict[int, object] = {}
    arbiters = []
    for peer_stage, lp in links.items():
        turn = None
        wl = spec.cluster.link(lp.src_dc, lp.dst_dc)
        slots = turn_slots(lp.sharing, wl.capacity_gbps, wl.rate_gbps(lp.connections), plan.dp) if wl is not None else 0
        if slots:   # else every pipeline always has a slot (or the link is fair): no turns
            order = turn_order(lp, plan.dp)
            # With tp > 1 each TP index has its own boundary traffic (same t to same t): its own ring of turns.
            key = f"{run}/{stage}->{peer_stage}" + (f"/t{t}" if plan.stage_tp(stage) > 1 else "")
            # The turn passes once the transfer has drained from the network's queue (transport.turns);
            # emulated links run at rate_scale of the spec's rates.
            scale = wan.rate_scale
            handoff = link_handoff(wl.capacity_gbps * scale, wl.rate_gbps(lp.connections) * scale,
                                   wl.latency_ms, slots)
            turn, arbiter = turns_via_store(store, key, replica, order, host=host,
                                            is_host=replica == order[0], timeout_s=timeout, slots=slots,
                                            secret=secret, handoff=handoff)
            if arbiter is not None:
                arbiters.append(arbiter)
            turn = RecordedTurns(turn, recorder, f"{my_dc}->{plan.dc_of(peer_stage, replica)}", stage)
        elif lp.sharing not in ("fair", "temporal"):
            raise GeotrainError(f"link {lp.src_dc}-{lp.dst_dc}: unknown sharing {lp.sharing!r} (fair, temporal)")
        # boundary tensors come from TP index t mod the peer's tp and go to t' = t mod this stage's tp
        # (runtime/interpreter.py; with one tp: the same index)
        tp_here, tp_peer = plan.stage_tp(stage), plan.stage_tp(peer_stage)
        peer_ts = sorted({t % tp_peer, *range(t, tp_peer, tp_here)})
        for d in range(plan.dp):
            for pt in peer_ts:
                peer = plan.rank(peer_stage, d, pt)
                conns[peer] = max(1, int(lp.connections))
                if turn is not None:
                    turns[peer] = turn
    hooks: dict[str, Any] = {}      # the emulation's instruments; a real WAN gets none of them
    if wan.mode == "shaper":
        hooks["shaper"] = fallback_shaper(spec.cluster, lambda r: plan.dc_of_rank(r), my_dc, wan.rate_scale)
    elif wan.mode == "kernel":
        # One htb per-connection bucket per connection, and disjoint blocks of buckets for the ranks
        # of one DC (they share the link's classes at the router).
        stride = max(conns.values(), default=1)
        hooks["connect"] = functools.partial(spread_port_connections, first_bucket=rank * stride)
    # The largest tensor a boundary carries (fp32 at most): the receiver refuses any message above it.
    max_message = plan.micro_batch * spec.model.seq_len * spec.model.hidden * 4
    striped = StripedTransport(rank, store, secret=secret, host=host, connections=lambda d: conns.get(d, 1),
                               turns=turns.get, prefix=f"{run}/striped", min_chunk_bytes=MIN_CHUNK_BYTES,
                               timeout_s=timeout, stall_s=wan.stall_s or min(DEFAULT_STALL_S, timeout / 4),
                               max_message_bytes=max_message, tls=wan.tls,
                               describe=lambda r: f"rank {r} ({plan.dc_of_rank(r)})", **hooks)
    for peer_stage, lp in links.items():   # one line per boundary in the rank's log: what carries it
        how = f"temporal, turn order {turn_order(lp, plan.dp)}" if lp.sharing == "temporal" else "fair"
        print(f"geotrain wan: rank {rank} ({my_dc}) -> stage {peer_stage} ({plan.dc_of(peer_stage, replica)}): "
              f"StripedTransport, {max(1, int(lp.connections))} connections, {how}, {wan.mode}"
              f"{f', boundaries {lp.compression}' if lp.compression != 'none' else ''}"
              f"{f', boundaries low-rank {lp.rank}' if lp.rank else ''}"
              f"{', TLS' if striped.tls is not None else ''} "
              f"(listening on {host}:{striped.port})\n", end="", file=sys.stderr, flush=True)   # one write per line
    clients = list({id(t): t for t in turns.values()}.values())
    wan_transport = T.HostStaging(striped)     # sockets move host memory; CUDA tensors are staged (pinned)
    per_peer = dict.fromkeys(conns, wan_transport)
    for peer_stage, lp in links.items():       # a link the plan compresses: encoded before the sockets
        if lp.compression != "none" or lp.rank > 0:
            packed = CompressedTransport(wan_transport, lp.compression, spec.model.hidden, lp.rank)
            per_peer.update({p: packed for p in conns if plan.coords(p)[0] == peer_stage})
    return T.RoutedTransport(default, per_peer, also_close=[*clients, *arbiters])
