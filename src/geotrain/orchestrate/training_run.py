"""`geotrain train` as a library function: resolve the run once, then train it here or as a torchrun rank.

`load_case` turns a spec or plan file (or objects) and a TrainConfig into the one RunCase every
rank runs: a plan file's plan as it is, a TOML spec's the planner's choice (`geotrain plan`), the
command line's plan overrides applied, checked. Under torchrun this process IS a rank, and a rank
never plans: it needs a plan file (`geotrain plan SPEC --out plan.json` once, then every host
trains that file) -- a TOML there is a one-line error. Without torchrun the built-in launcher
(`local_run`) starts one process per rank. Either way the simulator's prediction is written
beside the run (`calibrate.predict`), for `geotrain report`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from geotrain.calibrate.predict import write_prediction
from geotrain.calibrate.profile_file import load_profile
from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan, load_plan, plan_spec
from geotrain.orchestrate.local_run import train_locally
from geotrain.orchestrate.spec_check import load_experiment
from geotrain.planner.confirm import make_plan
from geotrain.process import exit_skipping_teardown
from geotrain.report.curves import draw_curves
from geotrain.runtime.cross_dc import bind_address
from geotrain.runtime.diloco_launch import torchrun_worker
from geotrain.runtime.run_lock import run_dir_lock
from geotrain.runtime.runfile import check_resumable as resume_checkpoint_every
from geotrain.runtime.runfile import latest_checkpoint
from geotrain.runtime.train_config import RunCase, TrainConfig, check_host_dc, report_rank
from geotrain.spec import Spec
from geotrain.transport.tls import check_tls_available

PLAN_OVERRIDES = ("schedule", "precision", "checkpointing", "sharding")


@dataclass
class TrainResult:
    out: Path                     # the run directory
    plan: Plan                    # the plan that ran last (an elastic run's last re-plan)
    losses: list[float]           # per step, as losses.jsonl holds them ([] on a torchrun rank without them)
    wan_mode: str                 # the WAN that ran: kernel, shaper, direct or off


def under_torchrun() -> bool:
    """This process is a rank started by torchrun (not by geotrain's own launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "GEOTRAIN_LAUNCHER_PID" not in os.environ


def load_case(source: str | Path | Spec, config: TrainConfig, plan: Plan | None = None,
              overrides: dict[str, Any] | None = None) -> RunCase:
    """The run: `source` a plan file, a TOML spec or a Spec; `plan` (with a Spec) the layout to run,
    else the plan file's, else the planner's choice; `overrides` replace plan fields (PLAN_OVERRIDES).
    A run directory not given is runs/<experiment>."""
    spec, name = _source(source, plan)
    if plan is None:
        plan = name[1] if name[1] is not None else make_plan(spec).plan
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    unknown = sorted(set(overrides) - set(PLAN_OVERRIDES))
    if unknown:
        raise GeotrainError(f"cannot override plan field {unknown[0]!r} (only {', '.join(PLAN_OVERRIDES)})")
    if overrides:
        plan = plan.with_(**overrides)
        if "checkpointing" in overrides:  # one mode for every stage, as asked
            plan = plan.with_(stages=tuple(replace(st, checkpointing=None) for st in plan.stages))
    if config.out is None:     # a plan file's own name ("plan") says nothing: name the run after the experiment
        config = config.with_(out=str(Path("runs") / name[0]))
    case = RunCase(spec, plan, config)
    case.schedule         # noqa: B018 -- refuses, in one line, what no rank could run: before any starts
    return case


def _source(source: str | Path | Spec, plan: Plan | None) -> tuple[Spec, tuple[str, Plan | None]]:
    """(spec, (the run's default name, the plan file's plan or None))."""
    if isinstance(source, Spec):
        return source, (source.path.stem if source.path else source.name, None)
    path = Path(source)
    if path.suffix != ".json":
        if plan is None and under_torchrun():
            raise GeotrainError(f"{path}: under torchrun every rank runs the same plan file and none plans: make "
                                f"it once (`geotrain plan {path} --out plan.json`), then train plan.json")
        return load_experiment(path), (path.stem, None)
    file_plan, doc = load_plan(path)
    spec = plan_spec(doc, path)         # the experiment the plan file carries (else the TOML it names)
    return spec, (Path(doc.get("spec") or spec.name).stem, file_plan)


def check_request(config: TrainConfig) -> TrainConfig:
    """What can be refused before anything is planned or started; returns the config with what the
    run directory's history implies (--resume keeps the interrupted run's --checkpoint-every)."""
    wan, el = config.wan, config.elastic
    if wan.tls:
        if wan.mode == "off":
            raise GeotrainError("--wan-tls encrypts the WAN transport, but --wan off sends plain gloo/NCCL")
        check_tls_available()
    if config.profile:      # a missing or foreign file is a user error before training, not after it
        load_profile(config.profile)
        config = config.with_(profile=str(Path(config.profile).resolve()))
    if under_torchrun():
        if wan.mode == "kernel":
            raise GeotrainError("--wan kernel starts the ranks itself; under torchrun use --wan auto, shaper or off")
        if el.enabled or el.cut_dc or el.cut_link:
            raise GeotrainError("--elastic, --cut-dc and --cut-link need geotrain's own launcher (under torchrun, "
                                "re-plan with `geotrain replan` and restart with --resume-from)")
        if config.serve is not None:
            raise GeotrainError("--serve-prefill is not available under torchrun yet; run the prefill service "
                                "with the built-in launcher (geotrain train without torchrun)")
    if config.resume.from_run:
        source = Path(config.resume.from_run)
        if latest_checkpoint(source / "checkpoints") is None:
            raise GeotrainError(f"--resume-from: no complete checkpoint in {source / 'checkpoints'}")
        config = config.with_(resume={"from_run": str(source.resolve())})
    return config


def check_resumable(config: TrainConfig) -> TrainConfig:
    """--resume needs a complete checkpoint, else it would silently start over (and truncate the run's
    losses); it keeps the interrupted run's --checkpoint-every unless a new one is given."""
    if not config.resume.own:
        return config
    return config.with_(checkpoint_every=resume_checkpoint_every(Path(config.out), config.checkpoint_every))


def train(source: str | Path | Spec, config: TrainConfig, plan: Plan | None = None,
          overrides: dict[str, Any] | None = None, say=print) -> TrainResult:
    """Train: on this machine with the built-in launcher, or as this torchrun rank (see the module
    docstring). `say` gets the progress lines of the launcher (the ranks print their own; None: quiet)."""
    say = say or (lambda line: None)
    config = check_request(config)
    if config.wan.timeout_s is not None:
        # A collective across a link that is down waits out the process group's timeout, not the WAN
        # transport's: bound it too (generously: start-up and checkpoint barriers on loaded hosts).
        config = config.with_(collective_timeout_s=max(120.0, 4 * config.wan.timeout_s))
    if under_torchrun() and config.wan.mode != "off":   # auto: the real network is the WAN
        mode = "direct" if config.wan.mode == "auto" else config.wan.mode
        config = config.with_(wan=config.wan.model_copy(update={"mode": mode, "bind": bind_address(config.wan.bind)}))
    case = load_case(source, config, plan, overrides)
    case = replace(case, config=check_resumable(case.config))
    if under_torchrun():
        return _train_as_rank(torchrun_worker(case))     # a DiLoCo plan: this worker's own job
    if case.config.diloco is not None:
        raise GeotrainError("--diloco-worker and --outer-store are for torchrun; geotrain's own launcher starts "
                            "every DiLoCo worker itself")
    out = Path(case.config.out)
    with run_dir_lock(out, say=say):      # one run per RUN_DIR
        result = train_locally(case, say=say)
        write_prediction(case.spec, result.plan, out, case.config.profile, result.wan_mode,
                         iterations=min(3, case.config.run_steps(case.spec)))
    if case.config.progress:       # (scripts and tests pass --no-progress: `geotrain report` draws it too)
        _draw_curves(out, say)
    return TrainResult(out, result.plan, _losses(out), result.wan_mode)


def _train_as_rank(case: RunCase) -> TrainResult:
    """This process is one torchrun rank: train, predict on the rank that holds the run directory,
    then leave without the interpreter's teardown (geotrain.process)."""
    rank, cfg = int(os.environ["RANK"]), case.config
    if cfg.dc is not None:
        check_host_dc(case.plan, rank, cfg.dc)
    reporter = rank == report_rank(case.plan)   # the run directory is the reporting rank's host's
    # here, not at the top: only a torchrun rank trains in this process; the launcher's never imports torch
    from geotrain.runtime.worker import run_cases

    with run_dir_lock(Path(cfg.out)) if reporter else contextlib.nullcontext():
        run_cases([case])
        if reporter:
            write_prediction(case.spec, case.plan, Path(cfg.out), cfg.profile, cfg.wan.mode,
                             iterations=min(3, cfg.run_steps(case.spec)))
    if reporter and cfg.progress:
        _draw_curves(Path(cfg.out), print)
    # Every output is written and the process group destroyed: leave without the interpreter's and
    # C++'s teardown, which can abort on gloo/TCPStore threads (see geotrain.process).
    exit_skipping_teardown(0)
    raise AssertionError("unreachable")


def _draw_curves(out: Path, say) -> None:
    """RUN_DIR/curves.png (loss, eval loss, lr, grad norm, tokens/s, step time; report.html embeds it)."""
    try:
        path = draw_curves(out)
    except ModuleNotFoundError as e:     # matplotlib is optional (the GPU machine's image has it; not all do)
        print(f"curves: not drawn ({e}); the run's files are complete", file=sys.stderr, flush=True)
        return
    if path is not None:
        say(f"curves: {path}  (TensorBoard: tensorboard --logdir {out / 'tb'})")


def _losses(out: Path) -> list[float]:
    path = out / "losses.jsonl"
    return [json.loads(x)["loss"] for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
