"""Model-family benchmark (not a test): per family, HF load time and step time beside the cost
model's prediction; for the mixture of experts, the all-to-all bytes of a step measured against
the cost model's.

    .venv/bin/python bench/bench_models.py [--hidden 256] [--layers 4] [--seq 128] [--reps 5]

1. families: one small random model per family, saved with transformers' own class
   (save_pretrained, fp32), then `geotrain`'s spec load (config.json + safetensors headers) and
   its weights load (`load_hf_weights`) timed; then forward + backward of one micro-batch on this
   CPU (median of --reps, the families alternated round by round so machine drift hits them
   alike), beside `CostModel.stage_times` on the "cpu" GPU type. The absolute ratio says how fast
   this CPU is against that type's nominal FLOP rate; what the cost model must get right is each
   family's ratio relative to Llama's (its extra work counted): the last column.
2. experts: the MoE family at pp=1 x dp=2 x ep=2 on two local processes (gloo): the rows each
   rank sent to the other in one forward and backward (runtime.expert_parallel's dispatch
   counts the forward; the backward's all-to-alls move the same rows back) against
   `costs.experts`: 4 all-to-alls of k x tokens x hidden x bytes, (ep-1)/ep of it leaving the
   GPU under balanced routing -- so the measured/model ratio is the routing's balance.
Numbers vary with machine load: quote the load average beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAMILIES = {   # transformers config class, extra kwargs (on top of the common shape)
    "llama": ("LlamaConfig", {}),
    "llama3.1": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 64}),
    "gemma": ("GemmaConfig", {"head_dim": 64}),
    "phi3": ("Phi3Config", {"pad_token_id": None, "eos_token_id": 2}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}),
}


def save_family(path: Path, name: str, args) -> None:
    import transformers

    cls, extra = FAMILIES[name]
    heads = max(1, args.hidden // 64)
    cfg = getattr(transformers, cls)(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                     num_hidden_layers=args.layers, num_attention_heads=heads,
                                     num_key_value_heads=max(1, heads // 2), max_position_embeddings=max(256, args.seq),
                                     **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def load_and_build(path: Path, seq: int):
    from geotrain.models.hf_weights import load_hf_weights
    from geotrain.models.llama import build_model
    from geotrain.spec.load import load_model

    (path.parent / f"{path.name}.toml").write_text(f'hf = "{path.name}"\nseq_len = {seq}\n')
    t0 = time.perf_counter()
    spec = load_model(path.parent / f"{path.name}.toml")
    model = build_model(spec)
    load_hf_weights(model, path, spec.tie_embeddings)
    return spec, model, time.perf_counter() - t0


def step_time(model, spec, args) -> float:
    tokens = torch.randint(0, spec.vocab, (args.micro_batch, args.seq))
    t0 = time.perf_counter()
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab), tokens.reshape(-1)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def families(args) -> None:
    from geotrain.costs import CostModel
    from geotrain.spec.cluster import BUILTIN_GPU_TYPES

    gpu = BUILTIN_GPU_TYPES["cpu"]
    tmp = Path(tempfile.mkdtemp(prefix="geotrain-models-"))
    built = {}
    for name in FAMILIES:
        save_family(tmp / name, name, args)
        built[name] = load_and_build(tmp / name, args.seq)
    times: dict[str, list[float]] = {n: [] for n in FAMILIES}
    for spec, model, _ in built.values():
        step_time(model, spec, args)                       # warm-up
    for _ in range(args.reps):
        for name, (spec, model, _) in built.items():
            times[name].append(step_time(model, spec, args))
    rows = []
    for name, (spec, _, load_s) in built.items():
        cost = CostModel(spec, precision="fp32")
        t = cost.stage_times(range(spec.num_units), gpu, args.micro_batch)
        rows.append((name, load_s, statistics.median(times[name]), t.forward + t.backward))
    base = rows[0][2] / rows[0][3]
    print(f"families: hidden {args.hidden}, {args.layers} layers, {args.micro_batch} x {args.seq} tokens, fp32, "
          f"median of {args.reps} (load {os.getloadavg()[0]:.1f})")
    print(f"{'family':10} {'load s':>8} {'step ms':>9} {'model ms':>9} {'meas/model':>11} {'vs llama':>9}")
    for name, load_s, meas, pred in rows:
        print(f"{name:10} {load_s:8.3f} {meas * 1e3:9.1f} {pred * 1e3:9.1f} {meas / pred:11.3f} "
              f"{meas / pred / base:9.3f}")


def _a2a_rank(rank: int, init: str, args, out: str) -> None:
    from geotrain.layout.plan import Plan, StagePlan
    from geotrain.models.moe import MoE
    from geotrain.models.presets import PRESETS
    from geotrain.runtime.materialize import build_chunk
    from geotrain.runtime.meshes import stage_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    shape = PRESETS["tiny-moe"]
    plan = Plan(stages=(StagePlan(dc="local", chunks=((0, shape.num_units),)),), dp=2, ep=2,
                micro_batch=args.micro_batch, num_microbatches=1, precision="fp32")
    chunk = build_chunk(shape, 0, shape.num_units, plan, stage_mesh("cpu", plan, 0), torch.device("cpu"))
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, shape.vocab, (args.micro_batch, shape.seq_len), generator=g)
    chunk(tokens).float().pow(2).mean().backward()
    sent = sum(m.dispatch.sent_bytes for m in chunk.modules() if isinstance(m, MoE))
    totals = torch.tensor([float(2 * sent)])      # the backward's all-to-alls move the same rows back
    dist.all_reduce(totals)
    if rank == 0:
        Path(out).write_text(str(float(totals) / 2))
    dist.destroy_process_group()


def experts(args) -> None:
    from geotrain.costs.experts import routed_bytes
    from geotrain.models.presets import PRESETS

    shape = PRESETS["tiny-moe"]
    out = tempfile.mktemp()
    mp.start_processes(_a2a_rank, args=(f"file://{tempfile.mktemp()}", args, out), nprocs=2, start_method="spawn")
    measured = float(Path(out).read_text())
    model = shape.layers * 4 * routed_bytes(shape, args.micro_batch, 4) * (2 - 1) / 2
    print(f"\nexperts: tiny-moe, ep=2, {args.micro_batch} x {shape.seq_len} tokens per rank, fp32 "
          f"(load {os.getloadavg()[0]:.1f})")
    print(f"all-to-all bytes per rank per step: measured {measured:,.0f}, cost model {model:,.0f} "
          f"(ratio {measured / model:.3f}: the routing's balance)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    families(args)
    experts(args)


if __name__ == "__main__":
    main()
