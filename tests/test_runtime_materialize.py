"""Stages are materialised already sharded: built on the meta device, sharded, then given storage.

One process plays rank 3 of a 4-rank DP group (torch's fake process group: building a chunk
communicates nothing). Every real storage created while the chunk is built is counted (a
DTensor by its local shard): under zero3 the peak is the rank's shard plus one initialisation
block, never the whole stage; and the shard holds exactly the rows of the same parameters of the
plain, unsharded model (the init is a function of the parameter's name, not of the layout).
"""

from __future__ import annotations

import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from geotrain.models.llama import INIT_BLOCK_ROWS, build_units
from geotrain.models.presets import PRESETS
from geotrain.runtime.materialize import build_chunk
from geotrain.spec.load import load_spec
from geotrain.torch_compat import TorchDispatchMode, tree_flatten

DP, RANK = 4, 3
ROOT = Path(__file__).parents[1]


class AllocatedBytes(TorchDispatchMode):
    """Live bytes of the real storages created under the mode, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self.largest = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = getattr(t, "_local_tensor", t)
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st._cdata in self.live or st.nbytes() == 0:
                continue
            self.live[st._cdata] = st.nbytes()
            self.current += st.nbytes()
            self.largest = max(self.largest, st.nbytes())
            weakref.finalize(st, self._free, st._cdata)
        self.peak = max(self.peak, self.current)
        return out


@pytest.fixture
def fake_dp_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=RANK, world_size=DP, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_zero3_stage_is_never_materialised_whole(fake_dp_group):
    from torch.distributed.device_mesh import init_device_mesh

    spec = PRESETS["tiny"]
    mesh = init_device_mesh("cpu", (1, DP, 1), mesh_dim_names=("pp", "dp", "tp"))
    plan = SimpleNamespace(tp=1, checkpointing="none", sharding="zero3", precision="bf16")
    with AllocatedBytes() as mode:
        chunk = build_chunk(spec, 0, spec.num_units, plan, mesh, torch.device("cpu"))
    params = dict(chunk.named_parameters())
    whole = sum(p.numel() * 4 for p in params.values())
    shard = sum(p.to_local().numel() * 4 for p in params.values())
    buffers = sum(b.numel() * 4 for b in chunk.buffers())
    widest = max(p.shape[-1] for p in params.values())
    block = INIT_BLOCK_ROWS * widest * 4                 # one init block drawn, and its copy
    padding = max(p.to_local().numel() * 4 for p in params.values())  # FSDP2 re-pads one shard at a time
    assert mode.peak <= shard + buffers + 2 * block + padding, (mode.peak, shard, whole)
    assert mode.peak < whole / 2
    assert mode.largest < max(p.numel() * 4 for p in params.values())  # no full-size tensor of any parameter
    # The shard holds its rows of the plain model's parameters.
    plain = dict(build_units(spec).named_parameters())
    for name, p in params.items():
        rows = -(-p.shape[0] // DP)
        torch.testing.assert_close(p.to_local(), plain[name].detach()[RANK * rows:(RANK + 1) * rows], rtol=0, atol=0)
    assert all(not b.is_meta for b in chunk.buffers())


@pytest.fixture
def hf_dir(tmp_path):
    """A sharded tiny HF checkpoint, saved before any process group exists (transformers saves
    config.json from rank 0 only)."""
    pytest.importorskip("transformers")
    from test_hf_models import make_hf_dir

    make_hf_dir(tmp_path, "gqa-sharded", layers=2, shard=True)
    return tmp_path


@pytest.fixture
def fake_tp_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_hf_weights_go_straight_into_tensor_parallel_shards(hf_dir, fake_tp_group, monkeypatch):
    """Rank 1 of tp=2: each column- or row-parallel weight reads only its own block of the
    checkpoint's tensor (rows of wq/wk/wv/w_gate/w_up, columns of wo/w_down, through safetensors'
    slices; no whole-tensor read), equal to the plain model's."""
    import safetensors

    whole: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            whole.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from geotrain.models.hf_weights import load_hf_weights
    from geotrain.models.shards import local_block
    from geotrain.spec.load import load_model

    spec = load_model(hf_dir)
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    plan = SimpleNamespace(tp=2, checkpointing="none", sharding="replicate", precision="fp32")
    chunk = build_chunk(spec, 0, spec.num_units, plan, mesh, torch.device("cpu"), hf=spec.hf)
    assert whole and not [n for n in whole if "proj" in n], whole   # norms, embedding, head: whole
    plain = build_units(spec, init=False)
    load_hf_weights(plain, spec.hf)
    sharded = 0
    for name, p in chunk.named_parameters():
        want = dict(plain.named_parameters())[name].detach()
        if isinstance(p, DTensor):
            shape, offset = local_block(p)
            want = want[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
            sharded += p.to_local().numel() < p.numel()
            p = p.to_local()
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=0)
    assert sharded == 2 * 7     # seven matmul weights per block, each split over the two TP ranks


@pytest.mark.parametrize("sharding", ["replicate", "zero1", "zero3"])
def test_a_tied_chunk_holding_both_ends_is_one_matrix(fake_dp_group, sharding):
    """to_empty (meta -> cpu) gives each module a new Parameter, so a tied head came out as a
    second copy: trained alike (`runtime.tied` summed their gradients) but counted twice in the
    global gradient norm, so clipping scaled a pp=1 run differently from a pipeline's."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = load_spec(ROOT / "examples" / "tiny_2dc.toml").model.model_copy(update={"tie_embeddings": True})
    mesh = init_device_mesh("cpu", (1, DP, 1), mesh_dim_names=("pp", "dp", "tp"))
    plan = SimpleNamespace(tp=1, checkpointing="none", sharding=sharding, precision="fp32")
    chunk = build_chunk(spec, 0, spec.num_units, plan, mesh, torch.device("cpu"))
    assert chunk.units[str(spec.num_units - 1)].out.weight is chunk.units["0"].tok.weight
    assert not any(n.endswith("out.weight") for n, _ in chunk.named_parameters())
