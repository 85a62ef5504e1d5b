"""examples/train_single.py, the smallest runnable path (one process, the runtime's model and
Trainer), runs and trains exactly like the reference loop the distributed runtime is held to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from _reference import single_process_losses

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("train_single", ROOT / "examples" / "train_single.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_single_process_example_trains_like_the_reference(capsys):
    example = _example()
    # One micro-batch holding the whole batch: bit for bit the reference (tiny_2dc's job: adamw, lr 1e-3, seed 0).
    assert example.train(steps=3, micro_batches=1, micro_batch=8) == \
        single_process_losses(ROOT / "examples" / "tiny_2dc.toml", 8, 1, 1, 3)
    # Four accumulated micro-batches: the same batch, summed in another order.
    got, want = example.train(steps=3), single_process_losses(ROOT / "examples" / "tiny_2dc.toml", 2, 4, 1, 3)
    assert all(abs(g - w) <= 1e-5 * w for g, w in zip(got, want, strict=True)), (got, want)
    assert "step   3  loss" in capsys.readouterr().out
