"""One run per run directory.

`run_dir_lock(RUN_DIR)` holds RUN_DIR for one run: a second run into it (its losses, checkpoints and
traces would interleave with the first's) is refused in one line naming the first. The lock is an
flock on RUN_DIR/.geotrain.lock, so a holder that died -- even by kill -9 -- holds nothing, and the
next run takes over and says so. The built-in launcher holds it for the whole command (every
relaunch of an elastic run included); under torchrun the reporting rank, whose host writes RUN_DIR.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from geotrain.errors import GeotrainError

LOCK_NAME = ".geotrain.lock"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, say=print) -> Iterator[None]:
    """Hold `run_dir` for this process while the block runs (see the module docstring)."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise GeotrainError(f"{run_dir}: cannot create the run directory's lock ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise GeotrainError(f"{run_dir} is in use by another run ({holder}); wait for it to end, or train "
                                "into another --out") from None
        earlier = os.pread(fd, 200, 0).decode(errors="replace").strip()
        if earlier:           # its holder ended without releasing it: killed (the flock went with it)
            say(f"geotrain: {run_dir}: took over the lock of a run that is no longer running ({earlier})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        try:
            yield
        except BaseException:
            if created and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
                # refused before it wrote anything (a request too big for this machine, a bad plan):
                # leave no empty run directory behind
                os.close(fd)
                fd = -1
                (run_dir / LOCK_NAME).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    run_dir.rmdir()
            raise
        os.ftruncate(fd, 0)   # released cleanly: nothing stale for the next run to report
    finally:
        if fd >= 0:
            os.close(fd)
