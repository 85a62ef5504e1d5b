"""geotrain train SPEC_OR_PLAN: train for real, one process per rank, executing the plan's schedule."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from geotrain.errors import GeotrainError
from geotrain.orchestrate.training_run import train
from geotrain.runtime.train_config import (
    DilocoConfig,
    ElasticConfig,
    ResumeConfig,
    ServeConfig,
    TrainConfig,
    WanConfig,
)

DESCRIPTION = (
    "Train following an experiment spec (the layout its [job] pins) or a plan file from `geotrain plan`. "
    "On one machine this starts one process per rank; under torchrun (RANK/WORLD_SIZE set) it runs as "
    "that rank. Writes RUN_DIR/losses.jsonl, measured_trace.jsonl, predicted_trace.jsonl, summary.json, "
    "and checkpoints/ when --checkpoint-every N (or job.checkpoint_every) asks for them."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    _run_arguments(p)
    _prefill_arguments(p)
    _wan_arguments(p)


def _run_arguments(p: argparse.ArgumentParser) -> None:
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


def _prefill_arguments(p: argparse.ArgumentParser) -> None:
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


def _wan_arguments(p: argparse.ArgumentParser) -> None:
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


# TrainConfig field -> the option that sets it, for one-line errors that name what the user typed.
FLAGS = {"worker": "--diloco-worker", "steps": "--steps", "checkpoint_every": "--checkpoint-every",
         "resume": "--resume-from", "timeout_s": "--outage-limit", "rate_scale": "--wan-rate-scale",
         "duty": "--prefill-duty", "port": "--serve-prefill", "elastic": "--cut-dc"}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the options ask for (checked: a bad value is a one-line error naming its option)."""
    try:
        serve = None if args.serve_prefill is None else ServeConfig(
            port=args.serve_prefill, model=args.prefill_model, priority=args.prefill_priority,
            duty=args.prefill_duty, token=args.prefill_token)
        return TrainConfig(
            out=args.out, steps=args.steps, checkpoint_every=args.checkpoint_every, data=args.data,
            progress=not args.no_progress, profile=args.profile, dc=args.dc, serve=serve,
            resume=ResumeConfig(own=args.resume, from_run=args.resume_from),
            wan=WanConfig(mode=args.wan, rate_scale=args.wan_rate_scale, tls=args.wan_tls, bind=args.wan_bind,
                          timeout_s=args.outage_limit),
            elastic=ElasticConfig(enabled=args.elastic, cut_dc=args.cut_dc, cut_link=args.cut_link),
            diloco=None if args.diloco_worker is None and not args.outer_store else
            DilocoConfig(worker=args.diloco_worker or 0, store=args.outer_store))
    except ValidationError as e:
        err = e.errors()[0]
        names = [str(x) for x in err["loc"]] or [e.title]
        flag = next((FLAGS[n] for n in reversed(names) if n in FLAGS), "--" + names[-1].replace("_", "-"))
        bound = {"greater_than": "must be positive", "greater_than_equal": "must be >= {ge}"}.get(err["type"])
        msg = f"{bound.format(**err.get('ctx', {}))} (got {err['input']})" if bound else err["msg"]
        raise GeotrainError(f"{flag}: {msg.removeprefix('Value error, ')}") from None


def run(args: argparse.Namespace) -> int:
    overrides = {"schedule": args.schedule, "precision": args.precision, "checkpointing": args.checkpointing,
                 "sharding": args.sharding}
    train(args.spec, config_from_args(args), overrides=overrides, say=lambda line: print(line, flush=True))
    return 0
