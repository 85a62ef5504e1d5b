"""Start one process per rank on this machine, watch them, and always clean up.

Each rank is a `python -m geotrain.runtime.worker` child with the torchrun environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and one CPU thread.
Every child leads its own process group, so the launcher can kill exactly its children (and
anything they started) by id on success, failure, Ctrl-C or SIGTERM; children also die with
the launcher (PR_SET_PDEATHSIG). The run's secret (the WAN transport's key) is a 0600 file named by
GEOTRAIN_SECRET_FILE, in a private folder (`process.private_dir`) removed when the run ends and swept at
the next start if the launcher was killed. The transport's outage lines are echoed from the rank
logs to the console (`log_echo`). The first rank to fail makes the run fail with a one-line
error naming it; its full traceback is in RUN_DIR/logs/rank<R>.log.

With `wan=` (a runtime.cross_dc.WanLaunch) each rank starts inside its datacenter's network namespace
(`plan.dc_of_rank`: a region plan's DP pipelines each in its own DC) with that namespace's
MASTER_ADDR / GLOO_SOCKET_IFNAME and its own NCCL host identity (`emulation.nccl.nccl_host_env`:
NCCL between DCs over the emulated link, P2P/SHM inside one; NCCL_* variables the user set are
kept), and every case gets the WAN transport config; tearing the
emulation down stays with whoever opened it (`run_with_wan` does both, and writes what crossed
each DC's emulated link to RUN_DIR/wan_bytes.json).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from geotrain.errors import GeotrainError
from geotrain.process import private_dir
from geotrain.runtime.cross_dc import open_wan
from geotrain.runtime.host_devices import check_local_devices
from geotrain.runtime.log_echo import OutageEcho
from geotrain.runtime.runfile import write_run_config
from geotrain.runtime.train_config import RunCase, report_rank
from geotrain.trace.metrics import LINK_COUNTERS_NAME
from geotrain.transport.auth import SECRET_ENV, new_secret, write_secret_file

WAN_BYTES_NAME = LINK_COUNTERS_NAME   # per DC, bytes it sent ("out") and received ("in") over the emulated WAN
MAX_LOCAL_RANKS = 64  # override with GEOTRAIN_MAX_LOCAL_RANKS on a big single host


def check_local_world_size(world_size: int) -> None:
    """Refuse to start more local processes than one machine can hold. A plan for a real cluster
    (`geotrain train examples/llama2_7b_a100_3dc.toml` asks for 1,536 ranks of a 7B model) used to
    set up the WAN, spawn processes until the machine choked, and never say why."""
    try:
        limit = int(os.environ.get("GEOTRAIN_MAX_LOCAL_RANKS", MAX_LOCAL_RANKS))
    except ValueError:
        raise GeotrainError("GEOTRAIN_MAX_LOCAL_RANKS must be an integer") from None
    if world_size > limit:
        raise GeotrainError(f"the plan has {world_size} ranks, more than the {limit} local processes one machine "
                            f"runs (GEOTRAIN_MAX_LOCAL_RANKS); run it under torchrun on its cluster, or train a "
                            f"smaller layout here")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_all(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while time.time() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)
    for p in procs:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


class RankFailure(GeotrainError):
    """A rank failed: the one-line message, and which ranks went first, for whoever reacts
    (the elastic launcher re-plans without their datacenter).

    killed: ranks that died by a signal before the launcher stopped anyone (a lost host, an OOM
    kill); first: the rank whose error came first (None if none wrote one); user_error: a bad plan
    or input, which no re-plan mends."""

    def __init__(self, message: str, killed: list[int], first: int | None, user_error: bool):
        super().__init__(message)
        self.killed, self.first, self.user_error = killed, first, user_error


def _first_error(err_dir: Path) -> dict | None:
    docs = []
    for f in err_dir.glob("rank*.json"):
        try:
            docs.append(json.loads(f.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    # A user error (bad plan) wins; else the earliest failure -- the others usually lost their peer.
    return min(docs, key=lambda d: (not d["user_error"], d["time"])) if docs else None


def _first_failure(err_dir: Path, procs: list[subprocess.Popen], describe, killed: list[int] = ()) -> str:
    d = _first_error(err_dir)
    if d is not None and d["user_error"]:
        return d["message"]
    if killed:   # a rank killed from outside went first; its peers' errors only say they lost it
        r = killed[0]
        more = f" (and {len(killed) - 1} more)" if len(killed) > 1 else ""
        return f"rank {r} ({describe(r)}) was killed by signal {-procs[r].returncode}{more}"
    if d is not None:
        msg = f"{d['type']}: {d['message']}" if d["message"] else d["type"]
        return f"rank {d['rank']} ({describe(d['rank'])}) failed: {msg}"
    for r, p in enumerate(procs):
        if p.returncode not in (0, None):
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"status {p.returncode}"
            return f"rank {r} ({describe(r)}) exited with {how}"
    return "a rank failed"


def launch(cases: list[RunCase], world_size: int, run_dir: Path, threads: int = 1,
           env: dict[str, str] | None = None, describe=lambda r: f"rank {r}", timeout_s: float | None = None,
           rank0_stdout: bool = True, wan=None, entry: str = "geotrain.runtime.worker", watch=None) -> None:
    """Run `cases` on `world_size` local processes; raise RankFailure naming the first failed rank.
    `entry` is the module each rank runs (`python -m ENTRY CONFIG.json`): the worker, or one that
    installs a plug-in first (`geotrain.orchestrate.rank_entry`). `watch(procs)`, if given, is called on
    every poll (rehearsals cut a datacenter's ranks from it). The rank owning the first case's loss
    prints to this process's stdout."""
    check_local_world_size(world_size)  # before anything is written
    if cases:
        check_local_devices(cases[0].plan)       # ranks sharing a GPU in a communicator NCCL cannot have
    if wan is not None:
        cases = [replace(c, config=c.config.with_(wan=wan.rank_config(c.config.wan))) for c in cases]
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg_path = logs / "run_config.json"
    write_run_config(cfg_path, cases)
    launch_ranks([sys.executable, "-m", entry, str(cfg_path)], world_size, logs, threads=threads, env=env,
                 describe=describe, timeout_s=timeout_s, rank0_stdout=rank0_stdout, wan=wan, watch=watch,
                 shown_rank=report_rank(cases[0].plan) if cases else 0)


def launch_ranks(argv: list[str], world_size: int, logs: Path, threads: int = 1, env: dict[str, str] | None = None,
                 describe=lambda r: f"rank {r}", timeout_s: float | None = None, rank0_stdout: bool = True,
                 wan=None, watch: Callable[[list[subprocess.Popen]], None] | None = None, shown_rank: int = 0) -> None:
    """Start `argv` once per rank with the torchrun environment, wait for all, clean up always.

    The one launcher: training ranks (`launch`) and the profiler's measurement processes
    (`calibrate.pool`) both start here. Each rank's output goes to LOGS/rank<R>.log; a rank that
    fails writes GEOTRAIN_ERROR_DIR/rank<R>.json, from which the error names the first failure.
    `watch(procs)` is called at every poll (rehearsals cut a datacenter's ranks; the profiler samples
    the CPU load meanwhile). With rank0_stdout, rank `shown_rank`'s stdout is the launcher's (a
    training run's: the rank that owns the loss)."""
    check_local_world_size(world_size)
    logs.mkdir(parents=True, exist_ok=True)
    err_dir = logs / "errors"
    for old in err_dir.glob("rank*.json"):
        old.unlink()
    (logs / "run_secret").unlink(missing_ok=True)   # an older geotrain kept it here
    secret_dir = private_dir("run")           # the WAN transport's per-run key: 0600, never on a command line;
    secret_path = write_secret_file(secret_dir / "secret", new_secret())   # swept at the next start after a kill -9
    port = free_port()
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(threads),
            "GEOTRAIN_ERROR_DIR": str(err_dir), "GEOTRAIN_LAUNCHER_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1",
            SECRET_ENV: str(secret_path)}
    procs: list[subprocess.Popen] = []
    files = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_term(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    in_main = _is_main_thread()
    if in_main:  # Ctrl-C and SIGTERM both end the run cleanly (also if SIGINT was inherited as ignored)
        for sig in previous:
            signal.signal(sig, on_term)
    try:
        for r in range(world_size):
            log = open(logs / f"rank{r}.log", "w")  # noqa: SIM115 -- closed in finally
            files.append(log)
            out = None if (r == shown_rank and rank0_stdout) else log
            env_r = {**base, "RANK": str(r), "LOCAL_RANK": str(r),
                     **(wan.env(r, port, base) if wan is not None else {})}
            start = wan.popen if wan is not None else (lambda _r, a, env, **kw: subprocess.Popen(a, env=env, **kw))
            procs.append(start(r, argv, env_r, stdout=out, stderr=log, stdin=subprocess.DEVNULL,
                               start_new_session=True))
        deadline = None if timeout_s is None else time.time() + timeout_s
        echo = OutageEcho(logs, world_size)          # a link down is said on the console, not only in the logs
        while True:
            echo.poll()
            codes = [p.poll() for p in procs]
            if any(c not in (0, None) for c in codes):
                killed = [r for r, c in enumerate(codes) if c is not None and c < 0]
                time.sleep(0.3)  # let the failing rank's peers notice, then pick the first failure
                first = _first_error(err_dir)
                raise RankFailure(_first_failure(err_dir, procs, describe, killed) + f" (logs: {logs})", killed,
                                  first["rank"] if first else None, bool(first and first["user_error"]))
            if all(c == 0 for c in codes):
                return
            broken = getattr(getattr(wan, "emulation", None), "failed", None)
            if broken:
                raise GeotrainError(f"{broken} (logs: {logs})")
            if watch is not None:
                watch(procs)
            if deadline is not None and time.time() > deadline:
                raise GeotrainError(f"the ranks did not finish within {timeout_s:.0f} s (logs: {logs})")
            time.sleep(0.05)
    finally:
        _kill_all(procs)
        shutil.rmtree(secret_dir, ignore_errors=True)
        for f in files:
            f.close()
        if in_main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_with_wan(cases: list[RunCase], run_dir: Path, say=print, on_wan=None, **kw):
    """`launch` over the WAN the first case's `config.wan` asks for (runtime.cross_dc.open_wan: mode,
    rate scale, TLS, how long a cross-DC transfer may wait), torn down afterwards -- also when a rank
    fails or on Ctrl-C. Returns the WanLaunch (closed; `.mode` says what ran). on_wan(wan), if given,
    sees the WAN before the ranks start (a rehearsal that cuts a link needs it)."""
    spec, plan, asked = cases[0].spec, cases[0].plan, cases[0].config.wan
    check_local_world_size(plan.num_ranks)  # before any WAN emulation is set up
    check_local_devices(plan)
    wan = open_wan(asked.mode, spec, plan, asked.rate_scale, say=say, tls=asked.tls,
                   **({"timeout_s": asked.timeout_s} if asked.timeout_s is not None else {}))
    try:
        if on_wan is not None:
            on_wan(wan)
        launch(cases, plan.num_ranks, run_dir, wan=wan, **kw)
    finally:
        wan.close()
        if wan.link_bytes:      # kernel emulation: what crossed each DC's emulated link, whoever sent it
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / WAN_BYTES_NAME).write_text(json.dumps(wan.link_bytes, indent=2) + "\n")
    return wan


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
