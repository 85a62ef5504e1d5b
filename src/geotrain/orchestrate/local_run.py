"""Train on this machine: one process per rank through the built-in launcher, over the asked WAN.

Around the launch: the data tokenized once before the ranks open its cache, BubbleTea's prefill
service (`config.serve`) started before and closed after, an elastic run re-planned after each
lost DC (`orchestrate.elastic`), what else the machine ran sampled into RUN_DIR/machine_load.json
(the report names it when a prediction is off), and what crossed the emulated WAN printed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from geotrain.bubbletea.model_source import describe_ref, model_spec
from geotrain.bubbletea.prefill_cost import headroom, inference_memory_bytes
from geotrain.calibrate.wanrun import RunSampling
from geotrain.console import human_bytes, number_runs, sent_received
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan
from geotrain.layout.wan_bytes import predicted_link_bytes
from geotrain.models.presets import PRESETS
from geotrain.orchestrate.elastic import CutWatcher, WorkerCuts, parse_cut, plot_losses, train_elastic
from geotrain.runtime.batches import make_source
from geotrain.runtime.diloco_launch import run_workers
from geotrain.runtime.host_devices import cuda_available
from geotrain.runtime.launch import run_with_wan
from geotrain.runtime.train_config import RunCase
from geotrain.sim.simulate import simulate
from geotrain.trace.metrics import MACHINE_LOAD_NAME
from geotrain.trace.schema import json_text

# The ranks' entry with BubbleTea's hook (named, not imported: it imports the worker, and torch).
RANK_ENTRY = "geotrain.orchestrate.rank_entry"


@dataclass
class LocalResult:
    plan: Plan            # the plan that ran last (an elastic run's last re-plan)
    wan_mode: str         # the WAN that ran


def train_locally(case: RunCase, say=print) -> LocalResult:
    cfg, spec, plan = case.config, case.spec, case.plan
    el = cfg.elastic
    cut = parse_cut(el.cut_dc, plan) if el.cut_dc else parse_cut(el.cut_link, plan, "link") if el.cut_link else None
    diloco = plan.num_workers > 1      # DiLoCo: --elastic restarts a lost worker, which rejoins (no re-plan)
    watch = None if cut is None else WorkerCuts(cut, plan, Path(cfg.out)) if diloco else \
        CutWatcher(cut, plan, Path(cfg.out) / "losses.jsonl")
    if el.enabled and not diloco and not cfg.saving_every(spec):
        raise GeotrainError("--elastic resumes from checkpoints: give --checkpoint-every N (or job.checkpoint_every)")
    data = cfg.data if cfg.data is not None else spec.job.data
    if data not in (None, "stdlib", "synthetic") or spec.model.hf:
        # Read and tokenize the data once here (bad data is refused before any rank starts), into the
        # memory-mapped cache every rank then opens.
        make_source(spec, plan, data, spec.job.seed, progress=cfg.progress)
    if cfg.progress:
        _say_layout(case, say)
    service, entry = None, "geotrain.runtime.worker"
    if cfg.serve is not None:
        service = _start_prefill(case, say)
        serve = cfg.serve.model_copy(update={"model": service.rank_config["inference_model"],
                                             "address": service.rank_config["address"],
                                             "secret_file": service.rank_config["secret_file"],
                                             "priority": service.rank_config["priority"]})
        case = replace(case, config=cfg.with_(serve=serve))
        entry = RANK_ENTRY  # the worker with BubbleTea's hook installed
    last: dict = {}

    def launch_once(case: RunCase, watch) -> None:
        def describe(r: int) -> str:
            s, d, _ = case.plan.coords(r)
            return f"stage {s}, replica {d}, {case.plan.dc_of(s, d)}"

        last["plan"] = case.plan
        out = Path(case.config.out)
        with RunSampling(None, period_s=0.5) as sampling:
            if case.plan.num_workers > 1:      # DiLoCo: one job per worker (runtime.diloco_launch), elastic inside
                last["wan"] = run_workers(case, say=say, entry=entry, watch=watch)
            else:
                last["wan"] = run_with_wan([case], out, say=say, describe=describe, entry=entry, watch=watch,
                                           on_wan=getattr(watch, "attach", None))
        (out / MACHINE_LOAD_NAME).write_text(json_text(sampling.machine_load()) + "\n")

    try:
        if el.enabled and not diloco:
            events = train_elastic(case, launch_once, say=say, cut=cut)
            if events:
                say(f"elastic: {len(events)} re-plan(s), see {Path(cfg.out) / 'elastic.jsonl'} and "
                    f"{plot_losses(Path(cfg.out))}")
        else:
            launch_once(case, watch)
    finally:
        if service is not None:
            service.close()
    crossed = last["wan"].link_bytes if "wan" in last else {}
    if crossed and cfg.progress:     # kernel emulation: what the run put on the emulated WAN
        say("WAN bytes (emulated links, whole run, the process group's collectives included): "
            + sent_received(crossed))
        steps, backend = cfg.run_steps(spec), "nccl" if cuda_available() else "gloo"
        say(f"WAN bytes predicted (layout.wan_bytes, {steps} iterations, {backend}): "
            + sent_received(predicted_link_bytes(spec, last["plan"], steps, backend)))
    return LocalResult(last["plan"], last["wan"].mode)


def _say_layout(case: RunCase, say) -> None:
    spec, plan, out = case.spec, case.plan, case.config.out
    say(f"training {spec.model.name} on {plan.num_ranks} local processes: pp={plan.pp} x dp={plan.dp}"
        + (f" x tp={plan.tp}" if plan.tp > 1 else "") + (f", ep={plan.ep}" if plan.ep > 1 else "") + ", "
        f"{plan.schedule}, {plan.precision}, checkpointing={plan.checkpointing_label()}, "
        f"sharding={plan.sharding}, global batch {plan.global_batch} x {spec.model.seq_len} tokens -> {out}")
    if plan.replica_dcs:
        say("region plan: " + "; ".join(f"{dc} ranks {number_runs(plan.ranks_of_dc(dc))}"
                                        for dc in plan.dcs_by_rank())
            + " (each DP pipeline inside one DC; only the gradient reduction crosses)")


def _start_prefill(case: RunCase, say):
    """BubbleTea's service, for a served model that fits beside training."""
    # here, not at the top: the service loads torch and the inference stack, only for --serve-prefill
    from geotrain.bubbletea.serve import start_service

    serve, out = case.config.serve, Path(case.config.out)
    ref = _prefill_model(serve.model, out)
    _check_headroom(case.spec, case.plan, ref)
    service = start_service(port=serve.port, inference_model=ref, token=serve.token, priority=serve.priority,
                            run_dir=str(out))
    say(f"BubbleTea: OpenAI-compatible API at {service.url}/v1 (model {service.service.model_name}; "
        f"metrics: {service.url}/metrics)")
    return service


def _prefill_model(ref: str, out: Path) -> str:
    """--prefill-model as the service and ranks load it: a preset, or an absolute HF directory
    (a training run's latest checkpoint is exported to RUN_DIR/prefill_model first)."""
    if ref in PRESETS:
        return ref
    path = Path(ref)
    if path.is_dir() and (path / "plan.json").is_file() and not (path / "config.json").is_file():
        from geotrain.runtime.hf_export import export_run  # here, not at the top: DCP and torch, for this only

        path, _ = export_run(path, out / "prefill_model")
    describe_ref(str(path))
    return str(path.resolve())


def _check_headroom(spec, plan, ref: str) -> None:
    """The served model must fit beside training on every GPU that prefills (the planner's check)."""
    m = model_spec(ref)
    room, _ = headroom(spec, plan, simulate(spec, plan).metrics.peak_memory)
    need = inference_memory_bytes(m, m.seq_len)
    if need > room:
        raise GeotrainError(f"--prefill-model: {m.name} needs {human_bytes(need)} beside training (weights, KV cache "
                            f"of {m.seq_len} tokens) but the tightest GPU has {human_bytes(room)} free")
