"""The GPU check (run by scripts/gpu_check.sh; --mode cpu runs the same checks on the CPU, tiny).

1. single: one rank trains bf16 under FSDP2 on the device; its losses must track the CPU fp32
   run of the same plan (same data, same init).
2. wan2: two ranks on the one device in two emulated datacenters (pp=2), the cross-DC link over
   the striped transport in user-space shaper mode (ranks sharing a GPU cannot use NCCL between
   them; the GPU machine may not allow network namespaces): it must train, and the measured trace
   must show the link's bytes.
3. units: per-unit forward/backward times measured on the device (CUDA events) beside the cost
   model's prediction for the cluster's GPU type -- the efficiency to put in the GPU type.
4. bubbletea: training step time with vs without prefill in the bubbles (bench_bubbletea_runtime).

Nothing is downloaded. Writes OUT/gpu_check.md (the tables) and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEOTRAIN = [sys.executable, "-m", "geotrain.cli"]
SIZES = {  # mode -> (model preset, steps, gpu type, micro-batch, global batch)
    "gpu": ("small", 15, "h100-80g", 4, 8),
    "cpu": ("tiny", 2, "cpu", 2, 4),
}


def _cluster(gpu_type: str, dcs: int) -> str:
    out = [f'name = "gpu-check-{dcs}dc"']
    for d in range(dcs):
        out += ["[[datacenters]]", f'name = "dc{d}"', f'gpu_type = "{gpu_type}"', "gpus = 1", "gpus_per_node = 1"]
    if dcs > 1:
        out += ["[[wan_links]]", 'between = ["dc0", "dc1"]', "latency_ms = 5", "capacity_gbps = 1.0",
                "per_connection_gbps = 0.5", "max_connections = 4"]
    return "\n".join(out) + "\n"


def _spec(out: Path, name: str, mode: str, precision: str, pp: int) -> Path:
    model, steps, gpu, mb, gb = SIZES[mode]
    (out / f"{name}_cluster.toml").write_text(_cluster(gpu, pp))
    path = out / f"{name}.toml"
    path.write_text(f'name = "{name}"\ncluster = "{name}_cluster.toml"\nmodel = "{model}"\n\n[job]\n'
                    f'global_batch = {gb}\nmicro_batch = {mb}\nprecision = "{precision}"\ncheckpointing = "none"\n'
                    f'sharding = "zero3"\nschedule = "1f1b"\npp = {pp}\ndp = 1\nsteps = {steps}\nlr = 1e-3\n')
    return path


def _train(spec: Path, run: Path, *extra: str, cpu: bool = False, timeout: float = 240) -> list[dict]:
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    r = subprocess.run([*GEOTRAIN, "train", str(spec), "--out", str(run), "--no-progress", "--data", "synthetic",
                        *extra],
                       env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"geotrain train {spec.name} failed: {(r.stderr or r.stdout).strip()[-800:]}")
    return [json.loads(x) for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def check_single(out: Path, mode: str) -> tuple[bool, list[str]]:
    ref = _train(_spec(out, "single_fp32", mode, "fp32", 1), out / "single_fp32", cpu=True)
    dev = _train(_spec(out, "single_bf16", mode, "bf16", 1), out / "single_bf16", cpu=mode == "cpu")
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(dev, ref))
    ok = len(dev) == len(ref) and worst <= 0.05 and dev[-1]["loss"] < dev[0]["loss"]
    rows = ["| step | CPU fp32 loss | device bf16 loss |", "| --- | --- | --- |"]
    rows += [f"| {a['step']} | {b['loss']:.4f} | {a['loss']:.4f} |" for a, b in zip(dev, ref)]
    rows.append(f"\nworst relative difference {worst:.2%} (limit 5%); device bf16 step time "
                f"{_mean_step(dev):.3f} s, CPU fp32 {_mean_step(ref):.3f} s")
    return ok, rows


def _mean_step(rows: list[dict]) -> float:
    tail = rows[1:] or rows
    return sum(r["step_time_s"] for r in tail) / len(tail)


def check_wan2(out: Path, mode: str) -> tuple[bool, list[str]]:
    run = out / "wan2"
    losses = _train(_spec(out, "wan2", mode, "bf16", 2), run, "--wan", "shaper", cpu=mode == "cpu")
    events = [json.loads(x) for x in (run / "measured_trace.jsonl").read_text().splitlines() if x.strip()]
    wan_bytes = sum(e.get("bytes", 0) for e in events if e.get("kind") == "transfer" and e.get("link"))
    ok = bool(losses) and losses[-1]["loss"] < losses[0]["loss"] + 0.5 and wan_bytes > 0
    return ok, [f"pp=2 over the striped transport (shaper): {len(losses)} steps, loss "
                f"{losses[0]['loss']:.4f} -> {losses[-1]['loss']:.4f}, mean step {_mean_step(losses):.3f} s, "
                f"{wan_bytes / 1e6:.2f} MB over the link"]


def check_units(mode: str) -> tuple[bool, list[str]]:
    import torch

    from geotrain.costs.cost_model import CostModel
    from geotrain.models.llama import build_units
    from geotrain.models.presets import PRESETS
    from geotrain.runtime.parallelize import autocast_context
    from geotrain.spec.cluster import BUILTIN_GPU_TYPES

    preset, _, gpu_name, mb, _ = SIZES[mode]
    spec = PRESETS[preset]
    device = torch.device("cuda" if mode == "gpu" else "cpu")
    gpu = BUILTIN_GPU_TYPES[gpu_name]
    cost = CostModel(spec, precision="bf16")
    rows = ["| unit | measured fwd / bwd (ms) | predicted fwd / bwd (ms) | efficiency that fits |",
            "| --- | --- | --- | --- |"]
    autocast = autocast_context("bf16", device)
    for name, unit in (("embedding", 0), ("block", 1), ("head", spec.layers + 1)):
        module = build_units(spec, unit, unit + 1).to(device)
        if unit == 0:
            x = torch.randint(0, spec.vocab, (mb, spec.seq_len), device=device)
        else:
            x = torch.randn(mb, spec.seq_len, spec.hidden, device=device, requires_grad=True)
        fwd, bwd = _time_unit(module, x, autocast, device, repeats=20 if mode == "gpu" else 3)
        pred = cost.stage_times(range(unit, unit + 1), gpu, mb)
        eff = gpu.efficiency * (pred.forward + pred.backward) / max(fwd + bwd, 1e-12)
        rows.append(f"| {name} | {fwd * 1e3:.3f} / {bwd * 1e3:.3f} | {pred.forward * 1e3:.3f} / "
                    f"{pred.backward * 1e3:.3f} | {eff:.3g} |")
    return True, rows


def _time_unit(module, x, autocast, device, repeats: int) -> tuple[float, float]:
    import torch

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    fwd = bwd = 0.0
    for i in range(repeats + 2):          # two warm-up rounds
        t0 = clock()
        with autocast():
            y = module(x)
        t1 = clock()
        y.float().sum().backward()
        t2 = clock()
        if i >= 2:
            fwd, bwd = fwd + t1 - t0, bwd + t2 - t1
    return fwd / repeats, bwd / repeats


def check_bubbletea(out: Path, mode: str) -> tuple[bool, list[str]]:
    spec = out / "wan2.toml"
    steps, warmup = ("20", "5") if mode == "gpu" else ("3", "1")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if mode == "cpu" else {})}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_bubbletea_runtime.py"), "--spec", str(spec),
                        "--steps", steps, "--warmup", warmup, "--rounds", "1", "--priority", "normal",
                        "--wan", "shaper", "--clients", "1"], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()][-8:]
    return r.returncode == 0, ["```", *lines, "```"] if lines else [f"failed: {r.stderr.strip()[-500:]}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--skip", default="", help="comma-separated checks to skip (single, wan2, units, bubbletea)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.mode == "gpu":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (use --cpu for the CPU rehearsal)", file=sys.stderr)
            return 2
    skip = set(filter(None, a.skip.split(",")))
    checks = [("single", lambda: check_single(out, a.mode)), ("wan2", lambda: check_wan2(out, a.mode)),
              ("units", lambda: check_units(a.mode)), ("bubbletea", lambda: check_bubbletea(out, a.mode))]
    report, failed = [f"# GPU check ({a.mode} mode)\n"], []
    for name, fn in checks:
        if name in skip:
            continue
        t0 = time.time()
        try:
            ok, rows = fn()
        except Exception as e:  # noqa: BLE001 -- a failed check is reported, the others still run
            ok, rows = False, [f"error: {type(e).__name__}: {e}"]
        status = "ok" if ok else "FAILED"
        print(f"gpu_check {name}: {status} ({time.time() - t0:.0f} s)", flush=True)
        for row in rows:
            print(f"  {row}", flush=True)
        report += [f"## {name}: {status}\n", *rows, ""]
        if not ok:
            failed.append(name)
    (out / "gpu_check.md").write_text("\n".join(report) + "\n")
    print(f"gpu_check: {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"(tables in {out / 'gpu_check.md'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
