"""Start a DiLoCo plan's workers on this machine: each worker its own torch.distributed job.

A worker is the plan's layout in its own DCs (`Plan.worker_plan`), started like any plan
(`launch.launch`: one process per rank, inside its DC's namespace under the kernel emulation),
with its own rendezvous -- so a worker that dies takes none of the others' process groups with it.
What the workers share is the outer store (`runtime.outer_store`, a process of its own in the
first worker's DC) and a secret (a 0600 file) that keys their outer transport. Worker 0 writes
into RUN_DIR, worker w > 0 into RUN_DIR/worker<w>.

A worker that fails is reported in one line and the others go on (runtime.outer_group drops it
from the exchanges once its heartbeat stops); the run fails only if every worker failed. With
`elastic` the lost worker is started again and rejoins (its new incarnation takes the others'
outer state at their next exchange and trains on from their step).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from geotrain.errors import GeotrainError
from geotrain.layout.workers import describe_outer
from geotrain.runtime.cross_dc import open_wan
from geotrain.runtime.launch import WAN_BYTES_NAME, free_port, launch
from geotrain.runtime.outer_store import READY
from geotrain.runtime.train_config import DilocoConfig, ResumeConfig, RunCase
from geotrain.transport.auth import new_secret, write_secret_file

STORE_START_S = 60.0
MAX_REJOINS = 3
REJOIN_WAIT_S = 300.0     # elastic: the others hold an exchange this long for a restarted worker


def worker_dir(run_dir: Path, w: int) -> Path:
    return Path(run_dir) if w == 0 else Path(run_dir) / f"worker{w}"


class _Stop(Exception):
    """Raised in a worker's watch: the launcher is stopping (Ctrl-C)."""


def _start_store(wan, dc: str, run_dir: Path) -> tuple[subprocess.Popen, str]:
    """The outer store's process, in `dc`'s namespace under the kernel emulation; its "host:port"."""
    host = wan.emulation.address(dc) if wan.emulation is not None else "127.0.0.1"
    argv = [sys.executable, "-m", "geotrain.runtime.outer_store", host, str(free_port())]
    if wan.emulation is not None:
        argv = ["ip", "netns", "exec", wan.emulation.netns(dc), *argv]
    log = open(Path(run_dir) / "logs" / "outer_store.log", "w")  # noqa: SIM115 -- the process keeps it
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    deadline = time.time() + STORE_START_S
    line = ""
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith(READY):
            return proc, line.split(" on ", 1)[1].strip()
    proc.kill()
    raise GeotrainError(f"the DiLoCo workers' store did not start ({line.strip() or 'no output'}; see "
                        f"{Path(run_dir) / 'logs' / 'outer_store.log'})")


def run_workers(case: RunCase, say=print, dead_after_s: float | None = None, watch=None, **kw):
    """Train DiLoCo case `case` (every worker of its plan, over the WAN its config asks for); returns the
    WanLaunch (closed), with `.lost` the workers that failed ({worker: message}). With
    `config.elastic.enabled` a worker that fails is started again (up to MAX_REJOINS times) and
    rejoins with the others' state (runtime.diloco)."""
    cfg, spec, plan = case.config, case.spec, case.plan
    run_dir, asked, elastic = Path(cfg.out), cfg.wan, cfg.elastic.enabled
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    wan = open_wan(asked.mode, spec, plan, asked.rate_scale, say=say, tls=asked.tls,
                   **({"timeout_s": asked.timeout_s} if asked.timeout_s is not None else {}))
    secret_file = run_dir / "logs" / "outer_secret"
    secret_file.unlink(missing_ok=True)
    write_secret_file(secret_file, new_secret())
    store = None
    stop = threading.Event()
    lost: dict[int, str] = {}
    try:
        store, address = _start_store(wan, plan.stages[0].dc, run_dir)
        W = plan.num_workers
        say(f"{describe_outer(plan.outer)}; their store at {address}")

        def one(w: int) -> None:
            wplan = plan.worker_plan(w)
            out = worker_dir(run_dir, w)
            view = replace(wan, rank_dc=[wplan.dc_of_rank(r) for r in range(wplan.num_ranks)])

            def watching(procs) -> None:
                if stop.is_set():
                    raise _Stop
                if watch is not None:
                    watch(w, procs)

            for incarnation in range(MAX_REJOINS + 1 if elastic else 1):
                # test hook: a fail_at entry (rank, step, worker) fails that worker only (its first start)
                meet = DilocoConfig(worker=w, store=address, secret_file=str(secret_file.resolve()),
                                    incarnation=incarnation, rejoin_wait_s=REJOIN_WAIT_S if elastic else 0.0,
                                    dead_after_s=dead_after_s or spec.job.diloco.dead_after_s)
                hooks = cfg.hooks.for_worker(w) if not incarnation else cfg.hooks.model_copy(update={"fail_at": []})
                one_case = replace(case, plan=wplan, config=cfg.with_(out=str(out), diloco=meet, hooks=hooks,
                                                                       resume=_worker_resume(cfg.resume, w,
                                                                                             incarnation)))
                try:
                    launch([one_case], wplan.num_ranks, out, wan=view, watch=watching, rank0_stdout=w == 0,
                           describe=lambda r: f"worker {w} rank {r}, {wplan.dc_of_rank(r)}", **kw)
                    lost.pop(w, None)
                    return
                except _Stop:
                    lost[w] = "stopped"
                    return
                except GeotrainError as e:
                    lost[w] = str(e)
                    again = elastic and incarnation < MAX_REJOINS and not stop.is_set()
                    say(f"DiLoCo: worker {w} lost: {e}" + ("; restarting it to rejoin from the other workers' "
                                                          "state" if again else ""))

        threads = [threading.Thread(target=one, args=(w,), name=f"worker{w}") for w in range(W)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except BaseException:
            stop.set()
            for t in threads:
                t.join()
            raise
        if len(lost) == W:
            raise GeotrainError("every DiLoCo worker failed: " + "; ".join(f"worker {w}: {m}"
                                                                          for w, m in sorted(lost.items())))
        if lost:
            say(f"DiLoCo: worker(s) {', '.join(map(str, sorted(lost)))} lost; the others finished")
    finally:
        if store is not None and store.poll() is None:
            store.terminate()
            try:
                store.wait(timeout=5)
            except subprocess.TimeoutExpired:
                store.kill()
        wan.close()
        secret_file.unlink(missing_ok=True)
        if wan.link_bytes:
            (run_dir / WAN_BYTES_NAME).write_text(json.dumps(wan.link_bytes, indent=2) + "\n")
    wan.lost = lost
    return wan


def _worker_resume(resume: ResumeConfig, w: int, incarnation: int) -> ResumeConfig:
    """Worker w's part of the run's --resume / --resume-from (another run: its worker w's directory);
    none for a restarted worker, which takes the others' state instead of its own last checkpoint."""
    if incarnation:
        return ResumeConfig()
    if resume.from_run:
        return ResumeConfig(from_run=str(worker_dir(Path(resume.from_run), w)))
    return resume


def torchrun_worker(case: RunCase) -> RunCase:
    """Under torchrun, a plan with DiLoCo workers runs as worker `config.diloco.worker`'s own job, meeting
    the others at `config.diloco.store` ("host:port" of `python -m geotrain.runtime.outer_store`); other
    plans as given."""
    plan, d = case.plan, case.config.diloco
    if plan.num_workers < 2:
        if d is not None:
            raise GeotrainError("--diloco-worker and --outer-store are for a plan with DiLoCo workers")
        return case
    if d is None or not d.store:
        raise GeotrainError(f"the plan trains {plan.num_workers} DiLoCo workers, each its own torchrun job: give "
                            "--diloco-worker W and --outer-store HOST:PORT")
    if not 0 <= d.worker < plan.num_workers:
        raise GeotrainError(f"--diloco-worker must be 0..{plan.num_workers - 1}")
    meet = d.model_copy(update={"dead_after_s": d.dead_after_s or case.spec.job.diloco.dead_after_s})
    return replace(case, plan=plan.worker_plan(d.worker), config=case.config.with_(diloco=meet))
