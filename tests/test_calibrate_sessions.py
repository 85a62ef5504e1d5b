"""The load diagnostics count what the autogroup scheduler shares the cores by: sessions."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from geotrain.calibrate.cpuload import CpuSampler, autogroup_enabled, runnable_sessions


@pytest.fixture
def spinners():
    """Two busy processes in ONE new session (a shell and its background child)."""
    p = subprocess.Popen(["sh", "-c", "while :; do :; done & while :; do :; done"], start_new_session=True)
    time.sleep(0.3)
    yield p
    os.killpg(p.pid, 9)
    p.wait()


def _seen(sid: int, exclude: set[int], tries: int = 20) -> bool:
    return any(sid in runnable_sessions(exclude) for _ in range(tries))


def test_a_session_of_two_busy_processes_is_one_competitor(spinners):
    sid = os.getsid(spinners.pid)
    assert _seen(sid, set())
    assert not _seen(sid, {sid}, tries=5)            # ours (a rank's session) is left out
    if autogroup_enabled():                           # the sampler counts sessions only where they matter
        s = CpuSampler(session_every=1)
        s.sample([spinners.pid])                      # the spinners as a run's rank: their session is ours
        assert s.background_sessions() is not None
