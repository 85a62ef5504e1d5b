"""runtime.measured_memory.LiveBytes, the CPU measurement every memory check rests on: new storages count
once (views and in-place results are not new), freed ones are subtracted, the peak is kept."""

import torch

from geotrain.runtime.measured_memory import LiveBytes, StepPeak, tensor_bytes


def test_live_bytes_counts_new_storages_once_and_forgets_freed_ones():
    x = torch.ones(1000)                       # made before: the caller's baseline, not counted
    with LiveBytes() as live:
        y = x * 2                              # 4000 B
        view = y[10:]                          # a view: same storage
        y.add_(1)                              # in place: same storage
        z = torch.cat([y, y])                  # 8000 B
        assert live.current == 12000
        del z
        assert live.current == 4000
        assert live.peak == 12000
    assert tensor_bytes([y, view, x]) == 8000  # two storages, the view counted with its base


def test_step_peak_adds_the_baseline_state():
    w = torch.zeros(256, requires_grad=True)
    peak = StepPeak(torch.device("cpu"))
    with peak.step([w]):
        (w * 3).sum().backward()               # w*3 (1 KiB, saved by nothing), then w.grad (1 KiB)
    assert peak.baseline == 1024
    assert 2048 <= peak.bytes <= 2048 + 16     # never both at once; + a few 0-d scalars
