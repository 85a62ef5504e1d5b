"""geotrain train SPEC_OR_PLAN: train for real, one process per rank, executing the plan's schedule."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import replace
from pathlib import Path

from geotrain.console import human_bytes, number_runs, sent_received
from geotrain.errors import GeotrainError, SpecError
from geotrain.models.presets import PRESETS
from geotrain.process import exit_skipping_teardown
from geotrain.trace.schema import json_text
from geotrain.transport.tls import check_tls_available

DESCRIPTION = (
    "Train following an experiment spec (the layout its [job] pins) or a plan file from `geotrain plan`. "
    "On one machine this starts one process per rank; under torchrun (RANK/WORLD_SIZE set) it runs as "
    "that rank. Writes RUN_DIR/losses.jsonl, measured_trace.jsonl, predicted_trace.jsonl, summary.json, "
    "and checkpoints/ when --checkpoint-every N (or job.checkpoint_every) asks for them."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC_OR_PLAN", help="experiment TOML or plan JSON")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: job.steps)")
    p.add_argument("--out", default=None, metavar="RUN_DIR", help="run directory (default: runs/<name>)")
    p.add_argument("--resume", action="store_true", help="continue from RUN_DIR's latest checkpoint")
    p.add_argument("--resume-from", default=None, metavar="RUN_DIR",
                   help="start from another run's latest complete checkpoint, resharded onto this plan's layout "
                        "(pp split, dp, sharding may differ; same model and global batch)")
    p.add_argument("--elastic", action="store_true",
                   help="when a datacenter's ranks die, re-plan without it (`geotrain replan`) and resume from the "
                        "last checkpoint on the new layout; RUN_DIR/elastic.jsonl and losses.png mark each re-plan")
    p.add_argument("--cut-dc", default=None, metavar="DC:STEP",
                   help="rehearsal: kill every rank of datacenter DC once step STEP is logged (with --elastic the run "
                        "continues on the rest)")
    p.add_argument("--cut-link", default=None, metavar="DC:STEP",
                   help="rehearsal (kernel WAN emulation): take datacenter DC's WAN interface down once step STEP is "
                        "logged; its transfers then fail after --outage-limit")
    p.add_argument("--outage-limit", type=float, default=None, metavar="S",
                   help="seconds a cross-DC transfer may wait before its rank fails (default 300); with --elastic the "
                        "run then continues without one side of the link")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="save every N steps (default: job.checkpoint_every; 0: never)")
    p.add_argument("--data", default=None, help="text file or directory to train on, or 'synthetic' "
                   "(default: job.data, else the built-in corpus)")
    p.add_argument("--schedule", default=None, help="override the plan's schedule kind")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"])
    p.add_argument("--checkpointing", default=None,
                   choices=["none", "full", "selective", "keep-matmul", "keep-attention"])
    p.add_argument("--sharding", default=None, choices=["replicate", "zero1", "zero2", "zero3"])
    p.add_argument("--no-progress", action="store_true", help="no progress bar or summary")
    p.add_argument("--serve-prefill", type=int, default=None, metavar="PORT",
                   help="BubbleTea: serve prefill requests on 127.0.0.1:PORT (0: any free port) and run them "
                        "in the ranks' pipeline bubbles while training")
    p.add_argument("--prefill-model", default="tiny", metavar="MODEL",
                   help="model --serve-prefill serves: a preset (tiny, untrained), a Hugging Face Llama directory "
                        "(with its tokenizer.json if any), or a training run directory (its latest checkpoint)")
    p.add_argument("--prefill-priority", default="auto", choices=["auto", "idle", "normal"],
                   help="CPU priority of BubbleTea work: idle = prefill on a SCHED_IDLE thread and the HTTP "
                        "service likewise, so they take only cores no training process wants (ranks sharing "
                        "cores); normal = as usual; auto = idle on CPU, normal with CUDA (default)")
    p.add_argument("--prefill-duty", type=int, default=0, metavar="N",
                   help="measure BubbleTea's cost: alternate N steps without prefill and N with it "
                        "(losses.jsonl marks each step's 'prefill'); default 0: always on")
    p.add_argument("--prefill-token", default=None, help="bearer token the prefill API requires (default: none)")
    p.add_argument("--wan", default="auto", choices=["auto", "kernel", "shaper", "off"],
                   help="the WAN between the plan's datacenters: kernel = one network namespace per DC joined by "
                        "an emulated WAN router (root); shaper = delay and rate limits inside the project's own "
                        "transport; auto = kernel where possible, else shaper (default); off = plain local run")
    p.add_argument("--profile", default=None, metavar="PROFILE.json",
                   help="predict with the calibrated simulation of this `geotrain profile` file (made on this "
                        "machine, same model and micro-batch) instead of the plain cost model, so `geotrain report` "
                        "compares the measurement with a calibrated prediction")
    p.add_argument("--wan-bind", default=None, metavar="ADDR",
                   help="under torchrun: the address this host's WAN transport listens on and connects from "
                        "(default: the local address of the route to MASTER_ADDR)")
    p.add_argument("--wan-tls", action="store_true",
                   help="encrypt cross-DC transport connections with TLS 1.3, keyed by the run's secret (no "
                        "certificates to distribute; needs the 'cryptography' package). Without it they are "
                        "authenticated (HMAC) but readable on the wire")
    p.add_argument("--dc", default=None, metavar="NAME",
                   help="under torchrun: the datacenter this host is in; every rank checks that the plan puts its "
                        "RANK there (a host started in the wrong node-rank order is a one-line error, not a silently "
                        "misplaced pipeline)")
    p.add_argument("--diloco-worker", type=int, default=None, metavar="W",
                   help="under torchrun, a plan with DiLoCo workers: this job is worker W (one job per worker)")
    p.add_argument("--outer-store", default=None, metavar="HOST:PORT",
                   help="under torchrun, DiLoCo: the workers' store (`python -m geotrain.runtime.outer_store HOST "
                        "PORT` on a host every worker reaches; every host the same GEOTRAIN_SECRET_FILE)")
    p.add_argument("--wan-rate-scale", type=float, default=1.0, metavar="X",
                   help="multiply every WAN capacity and per-connection cap (the emulator's packet delayer carries "
                        "~1 Gbit/s: for faster links use e.g. 0.01 with 100 Gbit/s; latency stays exact)")


def _config(args: argparse.Namespace):
    # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
    from geotrain.runtime.train_config import RunConfig

    path = Path(args.spec)
    plan_dict = None
    spec_path = path
    spec_doc = None
    if path.suffix == ".json":
        # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.layout.plan import load_plan, plan_spec
        from geotrain.spec.document import spec_document

        plan, doc = load_plan(path)
        spec = plan_spec(doc, path)   # the experiment the plan file carries (else the TOML it names)
        spec_doc = spec_document(spec)
        spec_path = Path(doc.get("spec") or spec.name)
        plan_dict = plan.to_dict()
    else:  # a spec: the plan `geotrain plan SPEC` chooses, pinned layout or not (every rank gets the same)
        # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.planner.confirm import make_plan
        from geotrain.spec import load_spec

        plan_dict = make_plan(load_spec(path)).plan.to_dict()
    overrides = {k: v for k, v in (("schedule", args.schedule), ("precision", args.precision),
                                    ("checkpointing", args.checkpointing), ("sharding", args.sharding)) if v}
    # A plan file's own name ("plan") says nothing: name the run after the experiment.
    out = args.out or str(Path("runs") / spec_path.stem)
    every = args.checkpoint_every
    if every is not None and every < 0:
        raise SpecError("--checkpoint-every", "", f"must be >= 0 (got {every})")
    if args.resume and args.resume_from:
        raise SpecError("--resume-from", "", "give --resume (this run's own checkpoint) or --resume-from, not both")
    if args.resume:
        from geotrain.runtime.checkpoint import check_resumable  # lazy: torch only when the command runs
        every = check_resumable(Path(out), every)
    resume_from = None
    if args.resume_from:
        # lazy: numpy, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
        from geotrain.runtime.checkpoint import latest_checkpoint

        if latest_checkpoint(Path(args.resume_from) / "checkpoints") is None:
            raise SpecError("--resume-from", "", f"no complete checkpoint in {Path(args.resume_from) / 'checkpoints'}")
        resume_from = str(Path(args.resume_from).resolve())
    return RunConfig(spec=str(path if spec_doc else spec_path), spec_doc=spec_doc, out=out, plan=plan_dict,
                     overrides=overrides, steps=args.steps, resume=args.resume, resume_from=resume_from,
                     checkpoint_every=every, data=args.data, progress=not args.no_progress)


def _profile(args: argparse.Namespace) -> str | None:
    """The --profile file, checked now: a missing or foreign file is a user error before training,
    not after it."""
    if not args.profile:
        return None
    # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
    from geotrain.calibrate.profile_file import load_profile

    load_profile(args.profile)
    return str(Path(args.profile).resolve())


def _prefill_model(ref: str, out: Path) -> str:
    """--prefill-model as the service and ranks load it: a preset, or an absolute HF directory
    (a training run's latest checkpoint is exported to RUN_DIR/prefill_model first)."""
    from geotrain.bubbletea.model_source import describe_ref  # lazy: pydantic only when the command runs
    if ref in PRESETS:
        return ref
    path = Path(ref)
    if path.is_dir() and (path / "plan.json").is_file() and not (path / "config.json").is_file():
        # lazy: numpy, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
        from geotrain.runtime.hf_export import export_run

        path, _ = export_run(path, out / "prefill_model")
    describe_ref(str(path))
    return str(path.resolve())


def _check_headroom(spec, plan, ref: str) -> None:
    """The served model must fit beside training on every GPU that prefills (the planner's check)."""
    # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.bubbletea.model_source import model_spec
    from geotrain.bubbletea.prefill_cost import headroom, inference_memory_bytes
    from geotrain.sim.simulate import simulate

    m = model_spec(ref)
    room, _ = headroom(spec, plan, simulate(spec, plan).metrics.peak_memory)
    need = inference_memory_bytes(m, m.seq_len)
    if need > room:
        raise GeotrainError(f"--prefill-model: {m.name} needs {human_bytes(need)} beside training (weights, KV cache "
                            f"of {m.seq_len} tokens) but the tightest GPU has {human_bytes(room)} free")


def run(args: argparse.Namespace) -> int:
    # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
    from geotrain.calibrate.predict import write_prediction
    from geotrain.runtime.run_lock import run_dir_lock
    from geotrain.runtime.train_config import resolve, resolve_run

    cfg = _config(args)
    profile = _profile(args)
    if args.steps is not None and args.steps < 1:
        raise GeotrainError("--steps must be at least 1")
    if args.wan_tls:
        if args.wan == "off":
            raise GeotrainError("--wan-tls encrypts the WAN transport, but --wan off sends plain gloo/NCCL")
        check_tls_available()
    if args.outage_limit is not None and not args.outage_limit > 0:
        raise GeotrainError(f"--outage-limit must be a positive number of seconds (got {args.outage_limit})")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "GEOTRAIN_LAUNCHER_PID" not in os.environ:
        # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
        from geotrain.runtime.cross_dc import bind_address
        from geotrain.runtime.rank_model import check_host_dc, report_rank
        from geotrain.runtime.worker import run_cases

        if args.wan == "kernel":
            raise GeotrainError("--wan kernel starts the ranks itself; under torchrun use --wan auto, shaper or off")
        if args.elastic or args.cut_dc or args.cut_link:
            raise GeotrainError("--elastic, --cut-dc and --cut-link need geotrain's own launcher (under torchrun, "
                                "re-plan with `geotrain replan` and restart with --resume-from)")
        if args.serve_prefill is not None:
            raise GeotrainError("--serve-prefill is not available under torchrun yet; run the prefill service "
                                "with the built-in launcher (geotrain train without torchrun)")
        if args.wan != "off":   # auto: the real network is the WAN; shaper: delay and rates emulated on top
            mode = "direct" if args.wan == "auto" else "shaper"
            cfg = replace(cfg, wan={"mode": mode, "rate_scale": args.wan_rate_scale,
                                    "bind": bind_address(args.wan_bind), "tls": args.wan_tls,
                                    **({"timeout_s": args.outage_limit} if args.outage_limit else {})})
        if args.outage_limit:   # the process group's waits too (a collective across a dead link), as locally
            os.environ.update(_limit_env(args.outage_limit))
        # lazy: pydantic, torch only when the command runs (keeps `geotrain --help` fast)
        from geotrain.runtime.diloco_launch import torchrun_worker

        cfg = torchrun_worker(cfg, args.diloco_worker, args.outer_store)   # a DiLoCo plan: one worker's job
        resolved = resolve_run(cfg)         # once: this process is the rank, and trains with it
        spec, plan, _ = resolved
        if args.dc is not None:
            check_host_dc(plan, int(os.environ["RANK"]), args.dc)
        # Under torchrun this process is one rank.
        reporter = int(os.environ["RANK"]) == report_rank(plan)   # the run directory is the reporting rank's host's
        with run_dir_lock(Path(cfg.out)) if reporter else contextlib.nullcontext():
            run_cases([cfg], bubble_hook=None, resolved=[resolved])
            if reporter:
                mode = (cfg.wan or {}).get("mode", "off")
                write_prediction(spec, plan, Path(cfg.out), profile, mode, iterations=_predicted_iterations(cfg, spec))
                if not args.no_progress:
                    _draw_curves(Path(cfg.out))
        # Every output is written and the process group destroyed: leave without the interpreter's and
        # C++'s teardown, which can abort on gloo/TCPStore threads (see geotrain.process).
        exit_skipping_teardown(0)
    spec, plan = resolve(cfg)  # user errors surface here, before any process starts
    with run_dir_lock(Path(cfg.out), say=lambda line: print(line, flush=True)):   # one run per RUN_DIR
        return _train_here(args, cfg, spec, plan, profile)


def _train_here(args: argparse.Namespace, cfg, spec, plan, profile) -> int:
    """`geotrain train` with the built-in launcher: one process per rank on this machine."""
    from geotrain.calibrate.predict import write_prediction  # lazy: numpy, pydantic, torch (as in run)
    from geotrain.layout.wan_bytes import predicted_link_bytes  # lazy: as above
    data = cfg.data if cfg.data is not None else spec.job.data
    if data not in (None, "stdlib", "synthetic") or spec.model.hf:
        # lazy: numpy, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
        from geotrain.runtime.batches import make_source

        # Read and tokenize the data once here (bad data is refused before any rank starts), into the
        # memory-mapped cache every rank then opens.
        make_source(spec, plan, data, spec.job.seed, progress=not args.no_progress)
    # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
    from geotrain.calibrate.wanrun import RunSampling
    from geotrain.runtime.launch import run_with_wan
    from geotrain.trace.metrics import MACHINE_LOAD_NAME

    if not args.no_progress:
        print(f"training {spec.model.name} on {plan.num_ranks} local processes: pp={plan.pp} x dp={plan.dp}"
              + (f" x tp={plan.tp}" if plan.tp > 1 else "") + (f", ep={plan.ep}" if plan.ep > 1 else "") + ", "
              f"{plan.schedule}, {plan.precision}, checkpointing={plan.checkpointing_label()}, "
              f"sharding={plan.sharding}, "
              f"global batch {plan.global_batch} x {spec.model.seq_len} tokens -> {cfg.out}", flush=True)
        if plan.replica_dcs:
            print("region plan: " + "; ".join(f"{dc} ranks {number_runs(plan.ranks_of_dc(dc))}"
                                              for dc in plan.dcs_by_rank())
                  + " (each DP pipeline inside one DC; only the gradient reduction crosses)", flush=True)

    service = None
    entry = "geotrain.runtime.worker"
    if args.serve_prefill is not None:
        # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
        from geotrain.bubbletea.serve import start_service
        from geotrain.orchestrate.rank_entry import ENTRY as RANK_ENTRY

        if args.prefill_duty < 0:
            raise GeotrainError(f"--prefill-duty must be >= 0 (got {args.prefill_duty})")
        prefill_model = _prefill_model(args.prefill_model, Path(cfg.out))
        _check_headroom(spec, plan, prefill_model)
        service = start_service(port=args.serve_prefill, inference_model=prefill_model,
                                token=args.prefill_token, priority=args.prefill_priority, run_dir=cfg.out)
        cfg = replace(cfg, bubbletea={**service.rank_config, "duty": args.prefill_duty})
        entry = RANK_ENTRY  # the worker with BubbleTea's hook installed
        print(f"BubbleTea: OpenAI-compatible API at {service.url}/v1 (model {service.service.model_name}; "
              f"metrics: {service.url}/metrics)", flush=True)
    # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
    from geotrain.orchestrate.elastic import CutWatcher, parse_cut, plot_losses, train_elastic

    if args.cut_dc and args.cut_link:
        raise GeotrainError("rehearse one failure at a time: --cut-dc or --cut-link")
    cut = parse_cut(args.cut_dc, plan) if args.cut_dc else parse_cut(args.cut_link, plan, "link") \
        if args.cut_link else None
    if args.elastic and not (cfg.checkpoint_every or spec.job.checkpoint_every):
        raise GeotrainError("--elastic resumes from checkpoints: give --checkpoint-every N (or job.checkpoint_every)")
    last = {}
    # A collective across a link that is down waits out the process group's timeout, not the WAN
    # transport's: bound it too (generously: start-up and checkpoint barriers on loaded hosts).
    collective_limit = _limit_env(args.outage_limit) if args.outage_limit else None

    def launch_once(cfg, spec, plan, watch) -> None:
        def describe(r: int) -> str:
            s, d, _ = plan.coords(r)
            return f"stage {s}, replica {d}, {plan.dc_of(s, d)}"

        last["plan"] = plan
        # What else ran on this machine meanwhile (RUN_DIR/machine_load.json): the report names it when
        # a prediction is off, since no profile taken before the run can know that load.
        with RunSampling(None, period_s=0.5) as sampling:
            if plan.num_workers > 1:      # DiLoCo: one job per worker (runtime.diloco_launch)
                # lazy: numpy, pydantic, torch, tqdm only when the command runs (keeps `geotrain --help` fast)
                from geotrain.runtime.diloco_launch import run_workers

                last["wan"] = run_workers(cfg, spec, plan, Path(cfg.out), mode=args.wan, rate_scale=args.wan_rate_scale,
                                          say=lambda line: print(line, flush=True), entry=entry, tls=args.wan_tls,
                                          outage_limit_s=args.outage_limit, env=collective_limit)
            else:
                last["wan"] = run_with_wan([cfg], spec, plan, Path(cfg.out), mode=args.wan,
                                           rate_scale=args.wan_rate_scale, describe=describe,
                                           say=lambda line: print(line, flush=True), entry=entry, watch=watch,
                                           outage_limit_s=args.outage_limit, on_wan=getattr(watch, "attach", None),
                                           env=collective_limit, tls=args.wan_tls)
        (Path(cfg.out) / MACHINE_LOAD_NAME).write_text(json_text(sampling.machine_load()) + "\n")

    try:
        if args.elastic:
            events = train_elastic(cfg, spec, plan, launch_once, say=lambda line: print(line, flush=True), cut=cut)
            if events:
                print(f"elastic: {len(events)} re-plan(s), see {Path(cfg.out) / 'elastic.jsonl'} and "
                      f"{plot_losses(Path(cfg.out))}", flush=True)
        else:
            launch_once(cfg, spec, plan, CutWatcher(cut, plan, Path(cfg.out) / "losses.jsonl") if cut else None)
    finally:
        if service is not None:
            service.close()
    crossed = last["wan"].link_bytes if "wan" in last else {}
    if crossed and not args.no_progress:     # kernel emulation: what the run put on the emulated WAN
        print("WAN bytes (emulated links, whole run, the process group's collectives included): "
              + sent_received(crossed), flush=True)
        import torch  # lazy, as above (already loaded by the runtime)

        steps, backend = cfg.steps or spec.job.steps, "nccl" if torch.cuda.is_available() else "gloo"
        print(f"WAN bytes predicted (layout.wan_bytes, {steps} iterations, {backend}): "
              + sent_received(predicted_link_bytes(spec, last["plan"], steps, backend)), flush=True)
    write_prediction(spec, last["plan"], Path(cfg.out), profile, last["wan"].mode,
                     iterations=_predicted_iterations(cfg, spec))
    if not args.no_progress:        # (scripts and tests pass --no-progress: `geotrain report` draws it too)
        _draw_curves(Path(cfg.out))
    return 0


def _draw_curves(out: Path) -> None:
    """RUN_DIR/curves.png (loss, eval loss, lr, grad norm, tokens/s, step time; report.html embeds it)."""
    # lazy: matplotlib only when a run has finished
    from geotrain.report.curves import draw_curves

    try:
        path = draw_curves(out)
    except ModuleNotFoundError as e:     # matplotlib is optional (the GPU machine's image has it; not all do)
        print(f"curves: not drawn ({e}); the run's files are complete", file=sys.stderr, flush=True)
        return
    if path is not None:
        print(f"curves: {path}  (TensorBoard: tensorboard --logdir {out / 'tb'})", flush=True)


def _limit_env(outage_limit_s: float) -> dict[str, str]:
    """--outage-limit for every rank: each cross-DC wait's bound, and the process group's timeout (generous
    beside it: start-up and checkpoint barriers on loaded hosts; a collective across a dead link waits it)."""
    return {"GEOTRAIN_OUTAGE_LIMIT_S": str(outage_limit_s),
            "GEOTRAIN_DIST_TIMEOUT_S": str(max(120.0, 4 * outage_limit_s))}


def _predicted_iterations(cfg, spec) -> int:
    """Iterations to simulate beside the run: a few (3), fewer if the run was shorter."""
    steps = cfg.steps or spec.job.steps
    return min(3, max(1, steps))
