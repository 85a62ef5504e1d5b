"""Prefill at the CPU's idle priority: it may take a core only when no training work wants it.

On a GPU a rank's bubble is idle device time. On a CPU, ranks share cores with each other and with
the service: when one rank waits, another rank's forward may be running on the core it would use,
so prefill at normal priority in that "bubble" takes time a training process needed. Linux's
SCHED_IDLE policy gives a thread a core only when nothing else is runnable on it -- the CPU
analogue of the lowest-priority GPU stream. Measured with `bench/bench_bubbletea_runtime.py
--duty 4` (steps with prefill vs without, inside one run) on 2 cores: the demo's pp=2 x dp=2,
1.037 idle vs 1.055 normal; pp=2 x dp=1, 1.011 vs 1.023. It does not make CPU work free on a
virtual machine (two SCHED_IDLE busy loops beside training cost it 15-20% here), which is why
the bubble budgets still bound what runs.

The policy is per thread, and an unprivileged thread may not leave SCHED_IDLE again, so prefill
runs on one long-lived thread that lowers itself once. The rank's main thread hands it a bubble's
work and waits for it, as it would wait for prefill run in place; torch releases the GIL while it
computes, so the main thread's waiting costs nothing.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
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
    """One daemon thread at the lowest CPU priority that runs the callables it is handed."""

    def __init__(self, name: str = "bubbletea-prefill"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.priority = "starting"
        ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _loop(self, ready: threading.Event) -> None:
        self.priority = lower_own_priority()
        ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                box.append((False, e))
            done.set()

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the low-priority thread; block until it returns (or raise what it raised)."""
        if not self._thread.is_alive():
            raise RuntimeError("the idle-priority thread has stopped")
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._jobs.put(None)
