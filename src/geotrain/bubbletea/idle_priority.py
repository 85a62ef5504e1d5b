"""Prefill at the CPU's idle priority: it may take a core only when no training work wants it.

On a CPU, ranks share cores with each other and with the service, so prefill at normal priority
in one rank's "bubble" takes time another rank needed. Linux's SCHED_IDLE gives a thread a core
only when nothing else is runnable on it -- the CPU analogue of the lowest-priority GPU stream. It
does not make CPU work free on a virtual machine (docs/DECISIONS.md, BubbleTea), so the bubble
budgets still bound what runs. The policy is per thread and an unprivileged thread may not leave
it, so prefill runs on one long-lived thread that lowers itself once; the rank's main thread hands
it a bubble's work and waits (torch releases the GIL while it computes).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def lower_own_priority() -> str:
    """Lower the calling thread (not its process) as far as the OS allows; says what it got."""
    if not sys.platform.startswith("linux"):
        return "normal"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # pid 0: the calling thread
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: per-thread nice
        return "nice 19"
    except (AttributeError, OSError):
        return "normal"


class IdlePriorityThread:
    """One worker thread at the lowest CPU priority that runs the callables it is handed: a
    one-thread ThreadPoolExecutor whose initializer lowers its thread, started at once so that
    `priority` (what the OS granted) and `native_id` are known from construction on."""

    def __init__(self, name: str = "bubbletea-prefill"):
        self.priority, self.native_id = "starting", None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._lower)
        self._pool.submit(int).result()

    def _lower(self) -> None:
        self.native_id = threading.get_native_id()
        self.priority = lower_own_priority()

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the low-priority thread; block until it returns (or raise what it raised)."""
        return self._pool.submit(fn).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
