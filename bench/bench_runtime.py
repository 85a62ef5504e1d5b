"""Runtime benchmarks (not a test): framework overhead, checkpointing x precision, sharding memory.

    .venv/bin/python bench/bench_runtime.py [--steps N] [--model small] [--skip-sharding]

1. overhead: `geotrain train` machinery at pp=1, dp=1 against a plain PyTorch loop of the same
   model, batch and micro-batching (median step time after warm-up; target <= 5%).
2. checkpointing none/full/selective x fp32/bf16/fp16 at pp=1, dp=1: step time, and bytes saved
   for backward per micro-batch (counted with saved_tensors_hooks) beside the cost model's
   activation prediction.
3. replicate/zero1/zero2/zero3 on 2 and 4 local ranks (dp only): per-rank parameter, gradient and
   optimizer-state bytes measured at the first optimizer step, beside CostModel.stage_memory.
Each table is measured side by side in one run of this script; numbers vary with machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

CLUSTER = """
[cluster]
name = "bench"
[[cluster.datacenters]]
name = "local"
gpu_type = "cpu"
gpus = 4
gpus_per_node = 4
intra_node_gbps = 40
intra_dc_gbps = 40
intra_dc_latency_us = 50
"""


def write_spec(tmp: Path, model: str, dp: int, precision: str = "fp32", checkpointing: str = "none",
               sharding: str = "replicate", global_batch: int = 8, micro_batch: int = 2, schedule: str = "1f1b",
               pp: int = 1) -> Path:
    path = tmp / f"{model}-{pp}x{dp}-{precision}-{checkpointing}-{sharding}-{schedule}.toml"
    path.write_text(f"""name = "bench"
model = "{model}"
[job]
global_batch = {global_batch * dp}
micro_batch = {micro_batch}
precision = "{precision}"
checkpointing = "{checkpointing}"
sharding = "{sharding}"
schedule = "{schedule}"
pp = {pp}
dp = {dp}
steps = 4
lr = 1e-3
{CLUSTER}""")
    return path


def init_single_rank() -> None:
    from geotrain.runtime.launch import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")


def runtime_step_times(spec: Path, out: Path, steps: int) -> list[float]:
    from geotrain.runtime.trainer import RunConfig, train

    train(RunConfig(spec=str(spec), out=str(out), steps=steps, data="synthetic", progress=False,
                    checkpoint_every=0))
    lines = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    return [x["step_time_s"] for x in lines[1:]]  # drop the warm-up step


def plain_step_times(spec_path: Path, steps: int) -> list[float]:
    """The reference: a textbook PyTorch loop over the same micro-batches (gradient accumulation)."""
    from geotrain.config.load import load_spec
    from geotrain.models.llama import build_model
    from geotrain.plan.manual import plan_from_job
    from geotrain.runtime.batches import SyntheticTokens
    from geotrain.runtime.pipeline import lm_loss

    spec = load_spec(spec_path)
    plan = plan_from_job(spec)
    model = build_model(spec.model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.job.lr)
    src = SyntheticTokens(spec.model.vocab, spec.model.seq_len, plan.micro_batch, plan.num_microbatches, 1, 0)
    times = []
    for step in range(steps):
        t = time.time()
        for j in range(plan.num_microbatches):
            x, y = src.batch(step, 0, j)
            (lm_loss(model(x), y) / plan.num_microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.time() - t)
    return times[1:]


def saved_bytes(spec_path: Path) -> int:
    """Bytes autograd keeps for backward for one micro-batch under the spec's checkpointing/precision."""
    from geotrain.config.load import load_spec
    from geotrain.models.llama import build_model
    from geotrain.plan.manual import plan_from_job
    from geotrain.runtime.checkpointing import apply_checkpointing
    from geotrain.runtime.parallelize import autocast_context

    spec = load_spec(spec_path)
    plan = plan_from_job(spec)
    model = build_model(spec.model)
    apply_checkpointing(model, plan.checkpointing)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    x = torch.randint(0, spec.model.vocab, (plan.micro_batch, spec.model.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(plan.precision,
                                                                                        torch.device("cpu"))():
        out = model(x)
    del out
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def predicted(spec_path: Path, inflight: int = 1):
    from geotrain.config.load import load_spec
    from geotrain.cost import CostModel
    from geotrain.plan.manual import plan_from_job

    spec = load_spec(spec_path)
    plan = plan_from_job(spec)
    cm = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                   optimizer=spec.job.optimizer)
    dc = spec.cluster.datacenters[0]
    return cm.stage_memory(plan.stages[0].units, spec.cluster.gpu(dc.gpu_type), plan.micro_batch, inflight,
                           plan.sharding, plan.dp)


def mib(x: float) -> str:
    return f"{x / 2**20:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="small")
    ap.add_argument("--skip-sharding", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_runtime_"))
    init_single_rank()

    print(f"## 1. framework overhead (pp=1, dp=1, {args.model}, fp32, 4 micro-batches of 2, 1 thread)")
    spec = write_spec(tmp, args.model, 1)
    plain, ours = [], []
    for rep in range(2):  # interleave to spread machine-load drift over both
        plain += plain_step_times(spec, args.steps)
        ours += runtime_step_times(spec, tmp / f"overhead{rep}", args.steps)
    p, o = statistics.median(plain), statistics.median(ours)
    print(f"plain loop {p * 1e3:8.1f} ms/step   geotrain runtime {o * 1e3:8.1f} ms/step   overhead {o / p - 1:+.1%}")

    print(f"\n## 2. checkpointing x precision (pp=1, dp=1, {args.model}); activation bytes per micro-batch")
    print("ckpt       prec   ms/step  saved-for-backward MiB (measured)  activations MiB (cost model)  "
          "total MiB (cost model)")
    for ckpt in ("none", "full", "selective"):
        for prec in ("fp32", "bf16", "fp16"):
            spec = write_spec(tmp, args.model, 1, precision=prec, checkpointing=ckpt)
            t = statistics.median(runtime_step_times(spec, tmp / f"ck-{ckpt}-{prec}", args.steps))
            pred = predicted(spec)
            # Selective checkpointing keeps its saved tensors inside the checkpoint's own frames,
            # invisible to saved_tensors_hooks: no honest count from here.
            meas = "     n/a" if ckpt == "selective" else mib(saved_bytes(spec))
            print(f"{ckpt:<10} {prec:<5} {t * 1e3:8.1f}  {meas}                           "
                  f"{mib(pred.activations)}                      {mib(pred.total)}")
    dist.destroy_process_group()

    if args.skip_sharding:
        return
    from geotrain.runtime.launch import launch
    from geotrain.runtime.trainer import RunConfig

    print(f"\n## 3. sharding: per-rank state at the first optimizer step ({args.model}, fp32, dp only)")
    print("ranks sharding   params MiB (meas/pred)  grads MiB (meas/pred)  optimizer MiB (meas/pred)  "
          "max RSS MiB (process, all cases)")
    for ranks in (2, 4):
        cases, specs = [], {}
        for sh in ("replicate", "zero1", "zero2", "zero3"):
            specs[sh] = write_spec(tmp, args.model, ranks, sharding=sh)
            cases.append(RunConfig(spec=str(specs[sh]), out=str(tmp / f"sh{ranks}-{sh}"), steps=2, data="synthetic",
                                   progress=False, checkpoint_every=0, trace=False))
        launch(cases, ranks, tmp / f"launch{ranks}", timeout_s=600)
        for sh in ("replicate", "zero1", "zero2", "zero3"):
            mem = json.loads((tmp / f"sh{ranks}-{sh}" / "summary.json").read_text())["memory_per_rank"]
            m = {k: max(r[k] for r in mem) for k in ("params", "grads", "optimizer", "max_rss")}
            pred = predicted(specs[sh])
            print(f"{ranks:>5} {sh:<9}  {mib(m['params'])} / {mib(pred.params)}  {mib(m['grads'])} / "
                  f"{mib(pred.grads)}  {mib(m['optimizer'])} / {mib(pred.optimizer)}  {mib(m['max_rss'])}")
    print("\nnote: zero2 holds gathered weights only between a forward and its backward, so at the optimizer "
          "step its measured params are sharded; the cost model's zero2 params are the peak.")
    print("note: the runtime keeps fp32 master weights and uses autocast; the cost model counts parameters and "
          "gradients in the training dtype, so bf16/fp16 predictions of those differ by design.")


if __name__ == "__main__":
    main()
