"""Out of file descriptors, on purpose: the listener tests queue a connection while every descriptor
of this process is taken, so the listener's accept() meets EMFILE, then free them and check it
accepts again."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def descriptors_exhausted(headroom: int = 64) -> Iterator[None]:
    """Inside the block this process can open no file or socket (create the client socket before it).
    The soft limit is lowered to what is open + `headroom` first, so filling it is quick; both are
    undone on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + headroom, hard))
    try:
        while True:
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
