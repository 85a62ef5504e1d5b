"""One rank of test_shared_gpu's FSDP2 check (2 ranks, gloo): FSDP2's all-gather and reduce-scatter go
through runtime.shared_gpu's host-staged comms, and the gradients equal one process's on the whole batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from geotrain.process import exit_skipping_teardown
from geotrain.runtime import shared_gpu as S

calls: list[str] = []
for cls in (S.StagedAllGather, S.StagedReduceScatter):
    def counted(self, *a, _orig=cls.__call__, _name=cls.__name__, **k):
        calls.append(_name)
        return _orig(self, *a, **k)
    cls.__call__ = counted

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


ref, sharded = model(), model()
for m in (sharded[0], sharded[2], sharded):
    fully_shard(m, mesh=mesh)
S.stage_fsdp(sharded)
torch.manual_seed(1)
x = torch.randn(world * 3, 8)
sharded(x[rank * 3:(rank + 1) * 3]).square().mean().backward()     # FSDP2 averages over the group
for i in range(world):
    ref(x[i * 3:(i + 1) * 3]).square().mean().div(world).backward()
ok = {"StagedAllGather", "StagedReduceScatter"} <= set(calls)
for p, q in zip(sharded.parameters(), ref.parameters(), strict=True):
    ok = ok and torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6)
print(f"calls {sorted(set(calls))} ok {ok}", flush=True)
dist.destroy_process_group()
exit_skipping_teardown(0 if ok else 1)   # as the ranks exit: gloo's threads abort a normal exit at times
