import os
import sys
import threading

import pytest

from geotrain.bubbletea.idle_priority import IdlePriorityThread, lower_own_priority


def test_runs_callables_returns_results_and_reraises():
    t = IdlePriorityThread()
    assert t.run(lambda: threading.get_native_id()) != threading.get_native_id()
    assert t.run(lambda: 6 * 7) == 42
    with pytest.raises(ZeroDivisionError):
        t.run(lambda: 1 / 0)
    assert t.run(lambda: "still serving") == "still serving"
    t.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread scheduling policy is Linux's")
def test_only_the_calling_thread_is_lowered():
    got = {}

    def body():
        got["priority"] = lower_own_priority()
        got["policy"] = os.sched_getscheduler(0)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    assert got["priority"] in ("idle", "nice 19")
    if got["priority"] == "idle":
        assert got["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER        # this (main) thread is untouched
