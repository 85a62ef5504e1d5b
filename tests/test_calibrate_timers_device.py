"""Calibrate's unit timers time on the rank's device with that device's clock: CUDA events on a
GPU (kernels run asynchronously: the host clock would time the launches), the host clock on the
CPU. Checked on the CPU: which clock each device gets, that the default device is the rank's, and
that the unit runner reads every interval from the selected clock."""

from __future__ import annotations

import torch

from geotrain.calibrate import timers
from geotrain.models.presets import PRESETS


def test_each_device_gets_its_own_clock():
    assert isinstance(timers.device_timer(torch.device("cpu")), timers.HostTimer)
    assert isinstance(timers.device_timer(torch.device("cuda", 1)), timers.CudaEventTimer)   # built, not used


def test_timers_default_to_the_ranks_device(monkeypatch):
    assert timers.timing_device(None) == torch.device("cpu")           # this machine: no CUDA
    monkeypatch.setattr(timers, "rank_device", lambda: torch.device("cuda", 1))
    assert timers.timing_device(None) == torch.device("cuda", 1)
    assert timers.timing_device("cpu") == torch.device("cpu")         # an explicit device wins


def test_the_unit_runner_reads_the_selected_clock(monkeypatch):
    picked = []

    class Ticks(timers.HostTimer):
        """A clock that ticks 1 s per mark: every interval the runner reports must come from it."""

        def __init__(self, device):
            super().__init__(device)
            picked.append(device)
            self.t = 0.0

        def mark(self) -> float:
            self.t += 1.0
            return self.t

    monkeypatch.setattr(timers, "device_timer", Ticks)
    once = timers.unit_runner(PRESETS["tiny"], 1, 1, "fp32")
    assert once() == (1.0, 1.0) and picked == [torch.device("cpu")]
