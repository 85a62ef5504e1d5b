"""Runtime benchmarks (not a test): framework overhead, checkpointing x precision, memory per rank.

    .venv/bin/python bench/bench_runtime.py [--steps N] [--model small] [--reps 2] [--skip-sharding]
        [--precisions fp32,bf16,fp16] [--skip-overhead] [--skip-trace | --only-trace]

0. tracing: step time with the measured trace on over off (runtime.recorder: events streamed to the
   rank's file, CUDA events resolved once completed -- no synchronisation per event), alternated.
1. overhead: `geotrain train` machinery at pp=1, dp=1 against a plain PyTorch loop of the same
   model, batch and micro-batching (median step time after warm-up; target <= 5%).
2. checkpointing none/selective/keep-matmul/keep-attention/full x fp32/bf16/fp16 at pp=1, dp=1:
   step time (arms alternated over `--reps` rounds, median), activation bytes of one micro-batch --
   measured as the storages a forward leaves alive (runtime.measured_memory.LiveBytes) beside the cost
   model's -- and the peak of a step, measured by the runtime (summary.json) beside the cost
   model's; then each checkpointing mode's activation cut and step-time cost against none (the
   seed's claim: up to 70% less activation memory for 15-25% more step time).
3. replicate/zero1/zero2/zero3 on 2 and 4 local ranks (dp only): peak per rank, measured vs
   predicted, and the state at the first optimizer step.
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


def runtime_step_times(spec: Path, out: Path, steps: int, trace: bool = False) -> list[float]:
    from geotrain.planner.manual import plan_from_job
    from geotrain.runtime.rank_run import run_rank
    from geotrain.runtime.train_config import RunCase, TrainConfig
    from geotrain.spec.load import load_spec

    loaded = load_spec(spec)
    run_rank(RunCase(loaded, plan_from_job(loaded), TrainConfig(out=str(out), steps=steps, data="synthetic",
                                                               progress=False, checkpoint_every=0, trace=trace)))
    lines = [json.loads(x) for x in (out / "losses.jsonl").read_text().splitlines()]
    # Drop the warm-up step and the second, on which the runtime measures memory (a dispatch mode
    # that sees every op: slower).
    return [x["step_time_s"] for x in lines[2:]]


def peak_per_stage(out: Path) -> list[dict]:
    return json.loads((out / "summary.json").read_text())["memory_per_stage"]


def plain_step_times(spec_path: Path, steps: int) -> list[float]:
    """The reference: a textbook PyTorch loop over the same micro-batches (gradient accumulation)."""
    from geotrain.models.llama import build_model
    from geotrain.planner.manual import plan_from_job
    from geotrain.runtime.batches import SyntheticTokens
    from geotrain.runtime.interpreter import lm_loss
    from geotrain.spec.load import load_spec

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


def activation_bytes(spec_path: Path) -> tuple[int, int]:
    """(measured, predicted) bytes one micro-batch keeps alive through the whole model's forward
    and loss, as the runtime runs it (autocast, checkpointing applied from outside)."""
    from geotrain.costs import CostModel
    from geotrain.models.llama import build_model
    from geotrain.planner.manual import plan_from_job
    from geotrain.runtime.activation_ckpt import apply_checkpointing
    from geotrain.runtime.interpreter import lm_loss
    from geotrain.runtime.measured_memory import LiveBytes
    from geotrain.runtime.parallelize import autocast_context
    from geotrain.spec.load import load_spec

    spec = load_spec(spec_path)
    plan = plan_from_job(spec)
    model = build_model(spec.model)
    apply_checkpointing(model, plan.checkpointing)
    x = torch.randint(0, spec.model.vocab, (plan.micro_batch, spec.model.seq_len))
    with LiveBytes() as live:
        with autocast_context(plan.precision, torch.device("cpu"))():
            out = model(x)
        loss = lm_loss(out, x)
        del out
    measured = live.current
    loss.backward()
    cm = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing)
    return measured, sum(cm.unit_activation_bytes(u, plan.micro_batch) for u in range(spec.model.num_units))


def mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="small")
    ap.add_argument("--reps", type=int, default=2, help="rounds over the checkpointing arms (alternated)")
    ap.add_argument("--skip-sharding", action="store_true")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--only-trace", action="store_true", help="only section 0 (tracing on vs off)")
    ap.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated precisions of section 2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench_runtime_"))
    init_single_rank()

    print(f"load average at start: {os.getloadavg()[0]:.1f} (other work on the machine inflates and scatters "
          "step times)")
    if not args.skip_trace:
        print(f"## 0. tracing (pp=1, dp=1, {args.model}, fp32, 4 micro-batches of 2, 1 thread): step time with the "
              f"measured trace on over off, alternated over {args.reps} rounds")
        spec = write_spec(tmp, args.model, 1)
        on, off = [], []
        for rep in range(args.reps):
            off += runtime_step_times(spec, tmp / f"trace-off{rep}", args.steps, trace=False)
            on += runtime_step_times(spec, tmp / f"trace-on{rep}", args.steps, trace=True)
        a, b = statistics.median(off), statistics.median(on)
        events = len((tmp / f"trace-on{args.reps - 1}" / "trace" / "rank0.jsonl").read_text().splitlines())
        print(f"trace off {a * 1e3:8.1f} ms/step   on {b * 1e3:8.1f} ms/step   ratio {b / a:.3f}   "
              f"({events} events in the rank's file, {args.steps} steps)")
        if args.only_trace:
            print(f"load average at end: {os.getloadavg()[0]:.1f}")
            dist.destroy_process_group()
            return
    if not args.skip_overhead:
        print(f"## 1. framework overhead (pp=1, dp=1, {args.model}, fp32, 4 micro-batches of 2, 1 thread)")
        spec = write_spec(tmp, args.model, 1)
        plain, ours = [], []
        for rep in range(2):  # interleave to spread machine-load drift over both
            plain += plain_step_times(spec, args.steps)
            ours += runtime_step_times(spec, tmp / f"overhead{rep}", args.steps)
        p, o = statistics.median(plain), statistics.median(ours)
        print(f"plain loop {p * 1e3:8.1f} ms/step   geotrain runtime {o * 1e3:8.1f} ms/step   "
              f"overhead {o / p - 1:+.1%}")

    print(f"\n## 2. checkpointing x precision (pp=1, dp=1, {args.model}, 4 micro-batches of 2, 1f1b); "
          f"arms alternated over {args.reps} rounds")
    from geotrain.planner.context import CHECKPOINTING_ORDER

    arms = [(c, p) for c in CHECKPOINTING_ORDER for p in args.precisions.split(",")]
    times: dict[tuple[str, str], list[float]] = {a: [] for a in arms}
    peaks: dict[tuple[str, str], dict] = {}
    for rep in range(args.reps):
        for ckpt, prec in arms:
            spec = write_spec(tmp, args.model, 1, precision=prec, checkpointing=ckpt)
            out = tmp / f"ck-{ckpt}-{prec}-{rep}"
            times[(ckpt, prec)] += runtime_step_times(spec, out, args.steps)
            peaks[(ckpt, prec)] = peak_per_stage(out)[0]
    print("| checkpointing | precision | ms/step | activations MiB measured | cost model | error "
          "| peak MiB measured | cost model | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    acts = {}
    for ckpt, prec in arms:
        meas, pred = acts[(ckpt, prec)] = activation_bytes(write_spec(tmp, args.model, 1, precision=prec,
                                                                       checkpointing=ckpt))
        pk = peaks[(ckpt, prec)]
        print(f"| {ckpt} | {prec} | {statistics.median(times[(ckpt, prec)]) * 1e3:.0f} | {mib(meas)} | {mib(pred)} "
              f"| {pred / meas - 1:+.1%} | {mib(pk['measured_peak'])} | {mib(pk['predicted_peak'])} "
              f"| {pk['error']:+.1%} |")
    print("\ncheckpointing against none (same precision): activation memory cut, step-time cost "
          "(seed claim: up to 70% less for 15-25% more time)")
    print("| checkpointing | precision | activations cut | peak cut | step time |")
    print("|---|---|---|---|---|")
    for ckpt, prec in arms:
        if ckpt == "none":
            continue
        base_a, base_t = acts[("none", prec)][0], statistics.median(times[("none", prec)])
        base_p = peaks[("none", prec)]["measured_peak"]
        print(f"| {ckpt} | {prec} | {1 - acts[(ckpt, prec)][0] / base_a:.0%} "
              f"| {1 - peaks[(ckpt, prec)]['measured_peak'] / base_p:.0%} "
              f"| {statistics.median(times[(ckpt, prec)]) / base_t - 1:+.0%} |")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    dist.destroy_process_group()

    if args.skip_sharding:
        return
    from geotrain.planner.manual import plan_from_job
    from geotrain.runtime.launch import launch
    from geotrain.runtime.train_config import RunCase, TrainConfig
    from geotrain.spec.load import load_spec

    print(f"\n## 3. sharding ({args.model}, fp32, dp only, 4 micro-batches of 2 per replica): peak per rank of a "
          "step, and the state at the first optimizer step")
    print("| ranks | sharding | peak MiB measured | cost model | error | params MiB | grads MiB | optimizer MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for ranks in (2, 4):
        cases, specs = [], {}
        for sh in ("replicate", "zero1", "zero2", "zero3"):
            specs[sh] = write_spec(tmp, args.model, ranks, sharding=sh)
            loaded = load_spec(specs[sh])
            cases.append(RunCase(loaded, plan_from_job(loaded), TrainConfig(
                out=str(tmp / f"sh{ranks}-{sh}"), steps=2, data="synthetic", progress=False, checkpoint_every=0,
                trace=False)))
        launch(cases, ranks, tmp / f"launch{ranks}", timeout_s=900)
        for sh in ("replicate", "zero1", "zero2", "zero3"):
            mem = json.loads((tmp / f"sh{ranks}-{sh}" / "summary.json").read_text())["memory_per_rank"]
            m = {k: max(r[k] for r in mem) for k in ("params", "grads", "optimizer")}
            pk = peak_per_stage(tmp / f"sh{ranks}-{sh}")[0]
            print(f"| {ranks} | {sh} | {mib(pk['measured_peak'])} | {mib(pk['predicted_peak'])} | {pk['error']:+.1%} "
                  f"| {mib(m['params'])} | {mib(m['grads'])} | {mib(m['optimizer'])} |")
    print("\nnote: FSDP2 (zero2/zero3) holds gathered weights and unsharded gradients during the step (the "
          "pipeline accumulates over micro-batches without gradient sync), so its peak is well above its "
          "sharded state at the optimizer step.")


if __name__ == "__main__":
    main()
