"""The Trainer owns the step and needs no process group: in one process, over the whole model, it
trains exactly like the textbook loop the distributed runtime is compared with (tests/_reference.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from _reference import single_process_losses

from geotrain.models.llama import build_model
from geotrain.runtime.batches import SyntheticTokens
from geotrain.runtime.recipe import param_groups
from geotrain.runtime.scaler import GlobalLossScaler
from geotrain.runtime.trainer import Trainer, make_optimizer
from geotrain.runtime.whole_model import WholeModel
from geotrain.spec.load import load_spec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_2dc.toml"


def _trainer(**kw):
    spec = load_spec(SPEC)
    torch.manual_seed(spec.job.seed)
    model = build_model(spec.model)
    params = list(model.parameters())
    return spec, Trainer(WholeModel(model), params, make_optimizer(param_groups([model], spec.job), spec.job),
                         job=spec.job, **kw)


def test_one_process_trainer_matches_the_reference_bit_for_bit():
    spec, trainer = _trainer()
    src = SyntheticTokens(spec.model.vocab, spec.model.seq_len, 2, 4, 1, spec.job.seed)
    losses = [trainer.step(step, {0: src.global_batch(step - 1)}).loss for step in range(1, 4)]
    assert losses == single_process_losses(SPEC, 2, 4, 1, 3)
    assert trainer.optimizer_steps == 3 and trainer.memory["optimizer"] > 0


def test_an_overflowed_fp16_step_is_skipped_and_backs_the_scale_off():
    spec, trainer = _trainer(scaler=GlobalLossScaler(True), inject_inf=[2])
    src = SyntheticTokens(spec.model.vocab, spec.model.seq_len, 2, 1, 1, spec.job.seed)
    trainer.step(1, {0: src.batch(0, 0, 0)})
    scale, before = trainer.scaler.scale, [p.detach().clone() for p in trainer.params]
    result = trainer.step(2, {0: src.batch(1, 0, 0)})
    assert result.skipped and trainer.scaler.scale == scale / 2
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.params))     # no update
    assert all(p.grad is None for p in trainer.params)                        # and no gradient left over
    assert not trainer.step(3, {0: src.batch(2, 0, 0)}).skipped and trainer.optimizer_steps == 2
