"""The cost model's activation bytes against what the real model keeps alive, for every
(precision, checkpointing) pair, per unit kind, on two shapes (GQA and plain multi-head).

Measured the way the runtime runs a unit: fp32 weights, `autocast_context` for bf16/fp16, blocks
wrapped by `runtime.activation_ckpt.apply_checkpointing`, the loss in fp32 outside autocast
(`pipeline.lm_loss`). Two witnesses:
  * `LiveBytes` (runtime/measured_memory.py): storages created by the forward that are still alive after
    it -- the only witness that sees inside checkpointed regions, whose tensors torch keeps in
    its own frames (non-reentrant checkpoint's recompute closure, selective checkpointing's
    cache), out of reach of saved-tensor hooks;
  * without checkpointing, also `saved_tensors_hooks` (deduplicated by storage): what autograd
    saves, plus the unit's output, must be the same bytes.
The model is derived op by op in costs/activations.py; equality is exact.
"""

import pytest
import torch

from geotrain.costs import CostModel
from geotrain.costs.activations import stage_input_bytes
from geotrain.models.llama import build_units
from geotrain.models.presets import PRESETS
from geotrain.runtime.activation_ckpt import apply_checkpointing
from geotrain.runtime.interpreter import lm_loss
from geotrain.runtime.measured_memory import LiveBytes, tensor_bytes
from geotrain.runtime.parallelize import autocast_context
from geotrain.spec.model import ModelSpec

MB = 2
SHAPES = {"tiny": PRESETS["tiny"],
          "mha": ModelSpec(name="mha", layers=2, hidden=48, heads=3, kv_heads=3, ffn=100, vocab=96, seq_len=32)}
# fp16 runs the same ops as bf16 at the same width: the newer selective policies are checked in bf16
PAIRS = [(p, c) for p in ("fp32", "bf16", "fp16") for c in ("none", "full", "selective")] + [
    (p, c) for p in ("fp32", "bf16") for c in ("keep-matmul", "keep-attention")]


def unit_input(spec, index):
    g = torch.Generator().manual_seed(index)
    if index == 0:
        return torch.randint(0, spec.vocab, (MB, spec.seq_len), generator=g)
    return torch.randn(MB, spec.seq_len, spec.hidden, generator=g).requires_grad_()


TARGETS = {}  # made outside the measurement: targets are data, counted with the batch


def forward(spec, index, unit, x, precision):
    """One unit's forward as a pipeline stage runs it; the head includes the loss."""
    with autocast_context(precision, torch.device("cpu"))():
        out = unit(x)
    if index == spec.num_units - 1:
        out = lm_loss(out, TARGETS.setdefault(spec.name, torch.zeros(MB, spec.seq_len, dtype=torch.long)))
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("precision", "checkpointing"), PAIRS)
def test_live_bytes_per_unit_kind(shape, precision, checkpointing):
    spec = SHAPES[shape]
    cost = CostModel(spec, precision=precision, checkpointing=checkpointing)
    model = build_units(spec)
    apply_checkpointing(model, checkpointing)
    TARGETS.setdefault(spec.name, torch.zeros(MB, spec.seq_len, dtype=torch.long))
    for i in (0, 1, spec.num_units - 1):      # embedding, a block, the head
        x = unit_input(spec, i)
        with LiveBytes() as live:
            out = forward(spec, i, model.units[str(i)], x, precision)
        assert live.current == cost.unit_activation_bytes(i, MB), (i, live.current)
        out.float().sum().backward()           # the graph was a real one


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_tensor_hooks_agree_without_checkpointing(shape, precision):
    spec = SHAPES[shape]
    cost = CostModel(spec, precision=precision, checkpointing="none")
    model = build_units(spec)
    state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    TARGETS.setdefault(spec.name, torch.zeros(MB, spec.seq_len, dtype=torch.long))
    for i in (0, 1, spec.num_units - 1):
        x = unit_input(spec, i)
        saved: dict[int, int] = {}

        def pack(t, saved=saved):
            st = t.untyped_storage()
            saved[st._cdata] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(spec, i, model.units[str(i)], x, precision)
        data = {x.untyped_storage()._cdata, TARGETS[spec.name].untyped_storage()._cdata}
        for key in state | data:  # weights, RoPE tables, the unit's input, the targets
            saved.pop(key, None)
        saved[out.untyped_storage()._cdata] = out.untyped_storage().nbytes()  # passed on to the next unit
        assert sum(saved.values()) == cost.unit_activation_bytes(i, MB), i


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective", "keep-matmul", "keep-attention"])
def test_a_stage_keeps_the_sum_of_its_units_and_its_input(checkpointing):
    """Units of one chunk share no storage; a non-first stage also keeps its fp32 input."""
    spec = PRESETS["tiny"]
    cost = CostModel(spec, precision="bf16", checkpointing=checkpointing)
    stage = build_units(spec, 2, spec.num_units)  # blocks 2..4 and the head
    apply_checkpointing(stage, checkpointing)
    TARGETS.setdefault(spec.name, torch.zeros(MB, spec.seq_len, dtype=torch.long))
    with LiveBytes() as live:
        x = unit_input(spec, 2).detach().to(torch.bfloat16).to(torch.float32).requires_grad_()
        loss = forward(spec, spec.num_units - 1, stage, x, "bf16")
    want = sum(cost.unit_activation_bytes(u, MB) for u in range(2, spec.num_units)) + stage_input_bytes(spec, MB)
    assert live.current == want
    assert tensor_bytes([x]) == stage_input_bytes(spec, MB)
    loss.backward()


@pytest.mark.parametrize(("precision", "checkpointing", "start", "end"), [  # two blocks; two blocks and the head
    ("fp32", "none", 1, 3), ("bf16", "none", 3, 6), ("fp32", "full", 3, 6), ("bf16", "full", 1, 3)])
def test_a_split_backward_keeps_the_deferred_bytes_until_w(precision, checkpointing, start, end):
    """Zero-bubble's B as the runtime runs it (`stage_backward_input`, the gradient received into a
    boundary-dtype buffer, the output's boundary copy kept by its send): what stays alive after B
    beyond the forward's bytes is `CostModel.deferred_bytes`; W then frees it."""
    from geotrain.runtime.activation_ckpt import weight_gradients_in_one_pass
    from geotrain.torch_compat import stage_backward_input

    spec = PRESETS["tiny"]
    cost = CostModel(spec, precision=precision, checkpointing=checkpointing)
    stage = build_units(spec, start, end)
    apply_checkpointing(stage, checkpointing)
    head = end == spec.num_units
    boundary = torch.float32 if precision == "fp32" else torch.bfloat16
    TARGETS.setdefault(spec.name, torch.zeros(MB, spec.seq_len, dtype=torch.long))
    with LiveBytes() as live:
        x = unit_input(spec, start).detach().clone().requires_grad_()
        out = forward(spec, end - 1 if head else start, stage, x, precision)
        sent = None if head else out.detach().to(boundary)         # held by its send until the optimizer
        received = None if head else torch.randn(out.shape).to(boundary).to(out.dtype)
        after_forward = live.current - (0 if head else tensor_bytes([received]))
        _, groups = stage_backward_input([out], None if head else [received], [x], stage.parameters())
        del out, received
        assert live.current - after_forward == cost.deferred_bytes(range(start, end), MB)
        weight_gradients_in_one_pass(stage.parameters(), groups)
        del groups
    assert all(p.grad is not None for p in stage.parameters())
    assert sent is not None or head


def test_one_pass_weight_gradients_equal_a_plain_backward():
    """W in one autograd pass (checkpointed chunks under a split backward) gives the gradients a
    plain backward gives."""
    from geotrain.runtime.activation_ckpt import weight_gradients_in_one_pass
    from geotrain.torch_compat import stage_backward_input

    spec = PRESETS["tiny"]
    x = unit_input(spec, 1).detach()
    g = torch.randn(MB, spec.seq_len, spec.hidden, generator=torch.Generator().manual_seed(7))
    grads = []
    for split in (False, True):
        stage = build_units(spec, 1, 3)
        apply_checkpointing(stage, "full")
        inp = x.clone().requires_grad_()
        out = stage(inp)
        if split:
            _, groups = stage_backward_input([out], [g], [inp], stage.parameters())
            weight_gradients_in_one_pass(stage.parameters(), groups)
        else:
            out.backward(g)
        grads.append([p.grad for p in stage.parameters()] + [inp.grad])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
