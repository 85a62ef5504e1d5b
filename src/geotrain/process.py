"""Ending a process that used torch.distributed's C++ threads; private temporary folders that
outlive no process.

`private_dir(kind)` makes a 0700 folder under the temporary directory named for the process that
owns it (geotrain-KIND-PID-*): the run's secret, the BubbleTea service's socket and secret, TLS key
files go there. Its owner removes it when done; after a kill -9 nothing can, so every new one first
sweeps the folders of owners that are no longer running (`sweep_private_dirs`).


gloo, the TCPStore (server and client) and socket threads can still be joinable when the
interpreter's static destructors run; C++ then aborts the process ("terminate called without an
active exception", exit -6), turning a run that finished and wrote all its output into a failure.
It happens intermittently (seen after checkpointed runs over the emulated WAN, and for a TCPStore
master whose peer was still connected), so every script that finishes such work ends through here.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

_PRIVATE = re.compile(r"^geotrain-([a-z]+)-(\d+)-")


def exit_skipping_teardown(code: int) -> None:
    """Flush stdout/stderr, then leave at once without interpreter or C++ static teardown.

    Call it only when every output is written and closed: buffered files other than stdout and
    stderr are not flushed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_private_dirs() -> list[Path]:
    """Remove this user's private folders whose owning process is gone; returns them."""
    gone = []
    for d in Path(tempfile.gettempdir()).glob("geotrain-*-*-*"):
        m = _PRIVATE.match(d.name)
        try:
            mine = d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid()
        except OSError:
            continue
        if m and mine and not _running(int(m.group(2))):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def private_dir(kind: str) -> Path:
    """A new 0700 folder geotrain-KIND-PID-* for this process's secrets and sockets (stale ones swept)."""
    sweep_private_dirs()
    return Path(tempfile.mkdtemp(prefix=f"geotrain-{kind}-{os.getpid()}-"))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts each worker in a session of its own, so the
    agent's process group does not hold them)."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out
