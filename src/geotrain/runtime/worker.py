"""Per-rank entry point: `python -m geotrain.runtime.worker CONFIG.json` (started by `launch.py`),
or `run_cases` called in-process when `geotrain train` itself runs under torchrun. An entry that
plugs something into the runtime (`geotrain.orchestrate.rank_entry`: BubbleTea) calls `main` with it.

CONFIG.json (`runfile.py`) holds RunCases run one after another on the same process group,
which lets tests pay the few seconds of process start-up once for several cases. A failing
rank writes ERROR_DIR/rank<R>.json (time, exception, traceback) so the launcher can name the
rank that failed first rather than the ones that merely lost their peer.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from geotrain.console import configure_logging
from geotrain.errors import GeotrainError
from geotrain.process import exit_skipping_teardown
from geotrain.runtime.cross_dc import bind_address
from geotrain.runtime.rank_model import rank_device
from geotrain.runtime.rank_run import FAILED_AT, BubbleHookFactory, run_rank
from geotrain.runtime.runfile import read_run_config
from geotrain.runtime.train_config import RunCase
from geotrain.torch_compat import default_store


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launcher dies, even if it is killed -9 (no orphans)."""
    parent = os.environ.get("GEOTRAIN_LAUNCHER_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


def backend_for(cuda: bool) -> str:
    """gloo alone on CPU; with CUDA both, "cpu:gloo,cuda:nccl": CUDA tensors (boundary tensors, FSDP,
    the loss) go over NCCL, the few CPU-side control tensors (the common clock, the end-of-run
    table) over gloo -- a backend per device type, as torch.distributed dispatches them."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_distributed(timeout_s: float = 600.0) -> None:
    if dist.is_initialized():
        return
    backend = backend_for(torch.cuda.is_available())
    if torch.cuda.is_available():
        torch.cuda.set_device(rank_device())
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def run_cases(cases: list[RunCase], bubble_hook: BubbleHookFactory | None = None) -> list[dict]:
    """Train each case in turn on this rank (one CPU thread unless OMP_NUM_THREADS says otherwise)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    init_distributed(max(c.config.collective_timeout_s for c in cases) if cases else 600.0)
    marks = cases[0].config.hooks.case_marks if cases else None
    try:
        out = []
        for i, c in enumerate(cases):
            if marks:
                _hand_over(Path(marks), i)
            out.append(run_rank(c, bubble_hook))
        if marks:
            _hand_over(Path(marks), len(cases))
        _leave_store_host_last()
        return out
    finally:
        dist.destroy_process_group()


def _leave_store_host_last(timeout_s: float = 30.0, linger_s: float = 1.0) -> None:
    """Under torchrun across hosts, after a clean run: ranks on the rendezvous store's host (MASTER_ADDR)
    leave after every other host's ranks (bounded wait), and a moment later. torchrun's agent there owns
    the store; when it exited first, the other hosts' agents, still leaving the rendezvous through it,
    printed a `TCPStore recvVector failed` C++ stack trace (exit 0)."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if "TORCHELASTIC_RUN_ID" not in os.environ or local >= world:
        return
    store = default_store()
    try:
        on_store_host = bind_address() == socket.gethostbyname(os.environ.get("MASTER_ADDR", ""))
    except (OSError, GeotrainError):
        return
    if not on_store_host:
        store.add("geotrain/left", 1)                       # not the store's host: leave now, counted
        return
    deadline = time.time() + timeout_s
    while store.add("geotrain/left", 0) < world - local and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(linger_s)


def _hand_over(marks: Path, i: int, timeout_s: float = 120.0) -> None:
    """Test hook (`hooks.case_marks` = DIR): before case i (and after the last), rank 0 writes DIR/ready<i>
    and waits for DIR/go<i> from whoever watches (a test reading the emulated links' counters between
    cases); then every rank meets it at a barrier. Nothing crosses the network meanwhile."""
    if dist.get_rank() == 0:
        (marks / f"ready{i}").write_text("")
        deadline = time.time() + timeout_s
        while not (marks / f"go{i}").exists():
            if time.time() > deadline:
                raise GeotrainError(f"hooks.case_marks: no go{i} in {marks} within {timeout_s:.0f} s")
            time.sleep(0.02)
    dist.barrier()


def write_error(e: BaseException) -> None:
    """ERROR_DIR/rank<R>.json for the launcher (`runtime.launch` names the first failure from these)."""
    err_dir = os.environ.get("GEOTRAIN_ERROR_DIR")
    if not err_dir:
        return
    rank = int(os.environ.get("RANK", -1))
    failed_at = getattr(e, FAILED_AT, None) or time.time()   # run_rank stamps it before closing the transport
    doc = {"rank": rank, "time": failed_at, "type": type(e).__name__, "message": str(e).strip().splitlines()[0]
           if str(e).strip() else "", "user_error": isinstance(e, GeotrainError), "traceback": traceback.format_exc()}
    path = Path(err_dir) / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def main(argv: list[str] | None = None, bubble_hook: BubbleHookFactory | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_parent()
    configure_logging()                 # the level the launcher's command was given ($GEOTRAIN_LOG_LEVEL)
    try:
        cases = read_run_config(Path(argv[0]))
        run_cases(cases, bubble_hook)
    except BaseException as e:  # noqa: BLE001 -- every failure must be reported to the launcher
        write_error(e)
        traceback.print_exc()
        exit_skipping_teardown(2 if isinstance(e, GeotrainError) else 1)
    # Success: every output is written and closed and the process group destroyed.
    exit_skipping_teardown(0)


if __name__ == "__main__":
    sys.exit(main())
