"""The families' new parameters under tensor parallelism: biases, Qwen3's q/k norms, Gemma's
(1 + w) norms and scaled embedding, sliding windows, Phi-3's partial RoPE, a MoE block's attention
and shared expert -- a tp=2 chunk built as a rank builds it (meta init, TP applied from outside,
materialised shard by shard) gives the single process's logits and, after one backward, its
gradients (every TP shard gathered back), within fp32 rounding.

One 2-rank gloo launch (torch.multiprocessing) runs every family back to back."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from geotrain.models.shape import ModelShape

BASE = dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64, seq_len=16)
FAMILIES = {
    "qwen3-bias-head_dim": dict(family="qwen3", head_size=16, qk_norm=True, qkv_bias=True, out_bias=True),
    "qwen2-window": dict(family="qwen2", qkv_bias=True, sliding_window=6),
    "llama-mlp_bias": dict(qkv_bias=True, out_bias=True, mlp_bias=True,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8}),
    "gemma": dict(family="gemma", head_size=16, act="gelu_tanh", norm_offset=True, embed_scale=True),
    "phi3-partial": dict(family="phi3", partial_rotary=0.5),
    "qwen2_moe-shared": dict(family="qwen2_moe", qkv_bias=True, experts=4, experts_per_token=2, expert_ffn=16,
                             shared_expert_ffn=24, norm_topk=False),
}


def shapes() -> dict[str, ModelShape]:
    return {k: ModelShape(name=k, **BASE, **v) for k, v in FAMILIES.items()}


def _rank(rank: int, world: int, init: str, out: str) -> None:
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor

        from geotrain.models.llama import build_model
        from geotrain.runtime.materialize import build_chunk

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("pp", "dp", "tp"))
        plan = SimpleNamespace(tp=world, checkpointing="none", sharding="replicate", precision="fp32")
        tokens = torch.randint(0, BASE["vocab"], (2, BASE["seq_len"]), generator=torch.Generator().manual_seed(0))
        bad = []
        for name, shape in shapes().items():
            whole = build_model(shape)
            chunk = build_chunk(shape, 0, shape.num_units, plan, mesh, torch.device("cpu"))
            for model in (whole, chunk):
                logits = model(tokens)
                (logits.float().pow(2).mean()).backward()
            torch.testing.assert_close(chunk(tokens), whole(tokens), rtol=1e-5, atol=1e-5)
            grads = dict(whole.named_parameters())
            for n, p in chunk.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                if not torch.allclose(g, grads[n].grad, rtol=1e-4, atol=1e-6):
                    bad.append(f"{name}: {n} off by {(g - grads[n].grad).abs().max().item():g}")
        if rank == 0:
            with open(out, "w") as f:
                f.write("\n".join(bad))
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


@pytest.mark.slow
def test_tp2_chunks_equal_the_single_process(tmp_path):
    init = f"file://{tempfile.mktemp(dir=tmp_path)}"
    out = str(tmp_path / "bad.txt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(2, init, out), nprocs=2, start_method="spawn", join=True)
    assert open(out).read() == ""
