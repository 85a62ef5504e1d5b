"""Saved-for-backward bytes of the real model, counted with saved-tensor hooks, against the model.

What is counted: every tensor autograd saves during the forward, deduplicated by storage (views
of one buffer count once), excluding parameters and registered buffers (the RoPE tables): those
are model state, accounted as weights, not activations.

Tolerance 0.1%: units.py lists the saved tensors one by one, so the only difference expected is
cross-entropy's 0-d `total_weight` (one scalar, 2-4 bytes) on the head; anything larger -- a
missed tensor, a wrong dtype, a new copy in llama.py -- is at least T*4 bytes, far above it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from geotrain.cost import CostModel
from geotrain.models.llama import build_model, build_units
from geotrain.models.presets import PRESETS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MB = 2


class SavedBytes:
    """Context manager: unique storages autograd saves inside it, minus the given module's state."""

    def __init__(self, module: torch.nn.Module):
        self.state = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
        self.seen: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.state:
            self.seen[st.data_ptr()] = st.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def run_unit(spec, index, unit, dtype, full=False):
    """Forward one unit the way a pipeline stage runs it; the head includes the loss."""
    g = torch.Generator().manual_seed(index)
    if index == 0:
        return unit(torch.randint(0, spec.vocab, (MB, spec.seq_len), generator=g))
    x = torch.randn(MB, spec.seq_len, spec.hidden, generator=g).to(dtype).requires_grad_()
    if index == spec.num_units - 1:
        targets = torch.randint(0, spec.vocab, (MB * spec.seq_len,), generator=g)
        return F.cross_entropy(unit(x).flatten(0, 1), targets)
    # Reentrant checkpointing saves its inputs with save_for_backward, which the hooks see.
    return checkpoint(unit, x, use_reentrant=True) if full else unit(x)


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_bytes_per_unit_without_checkpointing(name, precision):
    spec = PRESETS[name]
    cost = CostModel(spec, precision=precision, checkpointing="none")
    model = build_units(spec).to(DTYPES[precision])
    for i, unit in model.units.items():
        with SavedBytes(model) as saved:
            run_unit(spec, int(i), unit, DTYPES[precision])
        assert saved.total == pytest.approx(cost.unit_activation_bytes(int(i), MB), rel=1e-3), i


def test_whole_model_saved_bytes_are_the_sum_of_units():
    """No storage is shared between units (or double counted by the per-unit view)."""
    spec = PRESETS["tiny"]
    cost = CostModel(spec, precision="fp32")
    model = build_model(spec)
    tokens = torch.randint(0, spec.vocab, (MB, spec.seq_len))
    with SavedBytes(model) as saved:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    predicted = sum(cost.unit_activation_bytes(u, MB) for u in range(spec.num_units))
    assert saved.total == pytest.approx(predicted, rel=1e-3)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_full_checkpointing_keeps_only_the_block_input(name):
    spec = PRESETS[name]
    cost = CostModel(spec, precision="fp32", checkpointing="full")
    none = CostModel(spec, precision="fp32", checkpointing="none")
    model = build_units(spec)
    for i in range(1, spec.layers + 1):
        with SavedBytes(model) as saved:
            run_unit(spec, i, model.units[str(i)], torch.float32, full=True)
        assert saved.total == cost.unit_activation_bytes(i, MB) == cost.boundary_bytes(MB)
        assert saved.total < none.unit_activation_bytes(i, MB) / 10


def test_selective_checkpointing_drops_the_core_attention_outputs(monkeypatch):
    """Wrap SDPA in a checkpoint (recompute attention internals, Megatron's selective scheme)."""
    spec = PRESETS["small"]
    cost = CostModel(spec, precision="fp32", checkpointing="selective")
    sdpa = F.scaled_dot_product_attention

    def recomputed_sdpa(q, k, v, **kw):
        return checkpoint(lambda a, b, c: sdpa(a, b, c, **kw), q, k, v, use_reentrant=True)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recomputed_sdpa)
    model = build_units(spec)
    with SavedBytes(model) as saved:
        run_unit(spec, 1, model.units["1"], torch.float32)
    assert saved.total == pytest.approx(cost.unit_activation_bytes(1, MB), rel=1e-3)
    assert saved.total < CostModel(spec, precision="fp32").unit_activation_bytes(1, MB)
