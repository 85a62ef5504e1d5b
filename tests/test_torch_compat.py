"""geotrain.torch_compat: each private PyTorch API the package uses, exercised on the torch these tests
run under (scripts/test.sh runs this file under the pinned torch and the oldest supported one)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from geotrain import torch_compat as C
from geotrain.runtime.parallelize import fsdp_no_sync, fsdp_reduce_grads

pytestmark = pytest.mark.oldest_torch


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process (torn down after the test)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_the_version_parses():
    assert C.torch_version("2.11.0+cu130") == (2, 11)
    assert C.torch_version("2.13.0") == (2, 13)
    assert C.torch_version() >= C.OLDEST_TORCH


def test_fsdp_param_groups_and_the_pipeline_style_reduce(one_rank):
    """FSDP2's per-module groups (a list from torch 2.12, one group in 2.11) and the reduce that the
    interpreter runs at ALLREDUCE: gradients accumulated without sync, then reduced now, equal the
    plain model's (one rank: the reduce-scatter is the identity)."""
    ref, model = _model(), _model()
    for sub in (model[0], model[2]):
        fully_shard(sub, mesh=one_rank)
    fully_shard(model, mesh=one_rank)
    states = [fully_shard.state(m) for m in (model[0], model[2], model)]
    groups = [C.fsdp_param_groups(st) for st in states]
    assert [len(g) for g in groups] == [1, 1, 0]              # the root holds no parameter of its own here
    assert sum(len(g[0].fsdp_params) for g in groups[:2]) == 4
    x = torch.randn(3, 8)
    fsdp_no_sync(model)
    for _ in range(2):
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    fsdp_reduce_grads(model)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6), name


def test_default_store(one_rank):  # noqa: ARG001 -- the fixture makes the process group
    store = C.default_store()
    store.set("geotrain/compat", "yes")
    assert store.get("geotrain/compat") == b"yes"


def test_compute_local_shape_and_global_offset(one_rank):
    t = distribute_tensor(torch.arange(12.0).view(4, 3), one_rank, [Shard(0)])
    shape, offset = C.compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    assert (shape, offset) == ((4, 3), (0, 0))
    r = distribute_tensor(torch.zeros(5), one_rank, [Replicate()])
    assert C.compute_local_shape_and_global_offset(r.shape, r.device_mesh, r.placements) == ((5,), (0,))


def test_flatten_state_dict():
    flat, mapping = C.flatten_state_dict({"model": {"w": torch.ones(2)}, "step": 3})
    assert set(flat) == {"model.w", "step"}
    assert mapping["model.w"] == ("model", "w")


def test_split_backward_equals_a_plain_backward():
    """stage_backward_input then stage_backward_weight (zero-bubble's B and W): the same gradients as
    one backward, and the param groups carry what runtime.activation_ckpt reads from them."""
    ref, model = _model(), _model()
    x = torch.randn(3, 8)
    ref(x.clone().requires_grad_()).square().sum().backward()
    inp = x.clone().requires_grad_()
    out = model(inp).square().sum()
    (dx,), groups = C.stage_backward_input([out], None, [inp], model.parameters())
    assert dx is not None and dx.shape == x.shape
    assert groups and {"params", "intermediates"} <= set(groups[0])
    assert all(p.grad is None for p in model.parameters())      # weights wait for W
    C.stage_backward_weight(model.parameters(), groups)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)


def test_get_grad_fn_or_grad_acc():
    w = nn.Parameter(torch.ones(2))
    assert type(C.get_grad_fn_or_grad_acc(w)).__name__ == "AccumulateGrad"
    y = w * 2
    assert C.get_grad_fn_or_grad_acc(y) is y.grad_fn


def test_amp_unscale():
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found, inv = torch.zeros(1), torch.full((1,), 0.5)
    C.amp_unscale_(grads, found, inv)
    assert found.item() == 0 and grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0]
    C.amp_unscale_([torch.tensor([float("inf")])], found, inv)
    assert found.item() == 1


def test_dispatch_mode_sees_the_attention_op():
    """TorchDispatchMode and tree_flatten (runtime.measured_memory), and that scaled_dot_product_attention
    dispatches to one of `attention_ops` (what selective checkpointing keeps)."""
    seen = []

    class Ops(C.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 -- torch's signature
            seen.append((func, len(C.tree_flatten((args, kwargs))[0])))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, 2, 4, 8)
    with Ops():
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert {f for f, _ in seen} & C.attention_ops(), [f for f, _ in seen]
    assert all(n >= 1 for _, n in seen)
