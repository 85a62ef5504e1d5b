"""The GPU check (run by scripts/gpu_check.sh; --mode cpu runs the same checks on the CPU, tiny).

1. single: one rank trains bf16 under FSDP2 on the device; its losses must track the CPU fp32
   run of the same plan (same data, same init).
2. wan2: two ranks on the one device in two emulated datacenters (pp=2), the cross-DC link over
   the striped transport in user-space shaper mode (the GPU machine may not allow network
   namespaces): it must train, and the measured trace must show the link's bytes.
3. units: per-unit forward/backward times measured on the device beside the cost model's
   prediction for the cluster's GPU type -- the efficiency to put in the GPU type; it fails when
   the efficiency that fits the block is outside the limits (faster than the datasheet's peak, or
   far slower: a timing or device mistake).
4. shared: the demo's layout (examples/tiny_2dc.toml: pp=2 x dp=2, zero3, four ranks) on the one device:
   ranks sharing a GPU run FSDP2, the loss sum and the pipeline over gloo through host memory
   (runtime.shared_gpu; on CPU GEOTRAIN_FAKE_GPUS=1 stands in) -- it must train and say so.
5. bubbletea: training step time with vs without prefill in the bubbles (bench_bubbletea_runtime);
   it fails when nothing was answered, or (GPU mode) the ratio is outside its limits: slower than
   the limit, or so much faster that the measurement is noise.
6. predict: the `single` run simulated from unit times measured now on the device, beside its
   measured step time and peak memory: a row of the GPU validation's table (calibrate.gpu_measured),
   added to OUT/gpu_measured.json (`bench/bench_validate_gpu.py --measured OUT/gpu_measured.json`);
   it fails (GPU mode) when the iteration or the memory is off by more than its limit.

Nothing is downloaded. Prints one table, writes OUT/gpu_check.md (the table, then each check's
details) and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEOTRAIN = [sys.executable, "-m", "geotrain.cli"]
SIZES = {  # mode -> (model preset, steps, gpu type, micro-batch, global batch)
    "gpu": ("small", 15, "h100-80g", 4, 8),
    "cpu": ("tiny", 2, "cpu", 2, 4),
}
LOSS_LIMIT = 0.05                         # single: worst relative loss difference, bf16 device vs fp32 CPU
EFFICIENCY = {"gpu": (0.02, 1.0), "cpu": (0.0, 1.0)}     # units: the block's efficiency that fits
BUBBLETEA = {"gpu": (0.90, 1.05), "cpu": None}   # with / without prefill; CPU: ranks share cores, not judged
PREDICT = {"gpu": (0.25, 0.20), "cpu": None}     # predict: |iteration error|, |memory error|; CPU: the row only


@dataclass
class Result:
    ok: bool
    measured: str
    limit: str
    details: list[str] = field(default_factory=list)


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
                        *extra], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"geotrain train {spec.name} failed: {(r.stderr or r.stdout).strip()[-800:]}")
    return [json.loads(x) for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def _mean_step(rows: list[dict]) -> float:
    tail = rows[1:] or rows
    return sum(r["step_time_s"] for r in tail) / len(tail)


def single_verdict(dev: list[dict], ref: list[dict]) -> Result:
    worst = max((abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(dev, ref)), default=math.inf)
    ok = len(dev) == len(ref) > 0 and worst <= LOSS_LIMIT and dev[-1]["loss"] < dev[0]["loss"]
    rows = ["| step | CPU fp32 loss | device bf16 loss |", "| --- | --- | --- |"]
    rows += [f"| {a['step']} | {b['loss']:.4f} | {a['loss']:.4f} |" for a, b in zip(dev, ref)]
    rows.append(f"\ndevice bf16 step time {_mean_step(dev):.3f} s, CPU fp32 {_mean_step(ref):.3f} s")
    return Result(ok, f"worst loss difference {worst:.2%}, loss {dev[0]['loss']:.3f} -> {dev[-1]['loss']:.3f}",
                  f"<= {LOSS_LIMIT:.0%}, loss falls", rows)


def check_single(out: Path, mode: str) -> Result:
    ref = _train(_spec(out, "single_fp32", mode, "fp32", 1), out / "single_fp32", cpu=True)
    dev = _train(_spec(out, "single_bf16", mode, "bf16", 1), out / "single_bf16", cpu=mode == "cpu")
    return single_verdict(dev, ref)


def check_wan2(out: Path, mode: str) -> Result:
    run = out / "wan2"
    losses = _train(_spec(out, "wan2", mode, "bf16", 2), run, "--wan", "shaper", cpu=mode == "cpu")
    events = [json.loads(x) for x in (run / "measured_trace.jsonl").read_text().splitlines() if x.strip()]
    wan_bytes = sum(e.get("bytes", 0) for e in events if e.get("kind") == "transfer" and e.get("link"))
    ok = bool(losses) and losses[-1]["loss"] < losses[0]["loss"] + 0.5 and wan_bytes > 0
    return Result(ok, f"{wan_bytes / 1e6:.2f} MB over the link, loss {losses[0]['loss']:.3f} -> "
                      f"{losses[-1]['loss']:.3f}, step {_mean_step(losses):.3f} s", "bytes > 0, trains",
                  [f"pp=2 over the striped transport (shaper): {len(losses)} steps"])


def check_shared(out: Path, mode: str) -> Result:
    run = out / "shared"
    env = {"GEOTRAIN_FAKE_GPUS": "1", "CUDA_VISIBLE_DEVICES": ""} if mode == "cpu" else {}
    r = subprocess.run([*GEOTRAIN, "train", str(ROOT / "examples" / "tiny_2dc.toml"), "--steps", "3", "--wan", "shaper",
                        "--out", str(run), "--no-progress", "--data", "synthetic"],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"geotrain train tiny_2dc failed: {(r.stderr or r.stdout).strip()[-800:]}")
    losses = [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]
    note = next((ln for ln in (run / "logs" / "rank0.log").read_text().splitlines() if "share" in ln
                 and "host memory" in ln), "")
    ok = len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] + 0.5 and bool(note)
    return Result(ok, f"4 ranks, loss {losses[0]:.3f} -> {losses[-1]:.3f}; " + (note.split(": ", 1)[-1][:60] + "..."
                                                                            if note else "no staging line"),
                  "trains, says what it stages", [note or "(rank 0 did not say it staged anything)"])


def units_verdict(measured: dict[str, tuple[float, float]], fits: dict[str, float], mode: str) -> Result:
    """ok when every unit's times are finite and positive and the block's efficiency that fits lies
    within EFFICIENCY[mode] (a block faster than the datasheet's peak, or 50x slower, is a mistake)."""
    lo, hi = EFFICIENCY[mode]
    sane = all(f > 0 and b > 0 and math.isfinite(f + b) for f, b in measured.values())
    block = fits.get("block", math.nan)
    ok = sane and lo < block <= hi
    return Result(ok, f"block efficiency that fits {block:.3g}" + ("" if sane else ", a time not positive/finite"),
                  f"{lo:g} < e <= {hi:g}")


def check_units(mode: str) -> Result:
    import torch  # lazy: the check's set-up runs without torch until here

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
    measured, fits = {}, {}
    for name, unit in (("embedding", 0), ("block", 1), ("head", spec.layers + 1)):
        module = build_units(spec, unit, unit + 1).to(device)
        if unit == 0:
            x = torch.randint(0, spec.vocab, (mb, spec.seq_len), device=device)
        else:
            x = torch.randn(mb, spec.seq_len, spec.hidden, device=device, requires_grad=True)
        fwd, bwd = _time_unit(module, x, autocast, device, repeats=20 if mode == "gpu" else 3)
        pred = cost.stage_times(range(unit, unit + 1), gpu, mb)
        measured[name] = (fwd, bwd)
        if pred.forward + pred.backward > 0:       # the embedding is a lookup: the model prices it at ~0
            fits[name] = gpu.efficiency * (pred.forward + pred.backward) / max(fwd + bwd, 1e-12)
        rows.append(f"| {name} | {fwd * 1e3:.3f} / {bwd * 1e3:.3f} | {pred.forward * 1e3:.3f} / "
                    f"{pred.backward * 1e3:.3f} | {f'{fits[name]:.3g}' if name in fits else '-'} |")
    res = units_verdict(measured, fits, mode)
    res.details = rows
    return res


def _time_unit(module, x, autocast, device, repeats: int) -> tuple[float, float]:
    """Mean forward and backward seconds: CUDA events around each (read once at the end), wall clock on CPU."""
    import torch  # lazy: as above

    cuda = device.type == "cuda"
    marks = []
    for i in range(repeats + 2):          # two warm-up rounds
        m = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else [0.0, 0.0, 0.0]
        for k, step in enumerate(("f", "b", None)):
            if cuda:
                m[k].record()
            else:
                m[k] = time.perf_counter()
            if step == "f":
                with autocast():
                    y = module(x)
            elif step == "b":
                y.float().sum().backward()
        if i >= 2:
            marks.append(m)
    if cuda:
        torch.cuda.synchronize()
        spans = [(a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3) for a, b, c in marks]
    else:
        spans = [(b - a, c - b) for a, b, c in marks]
    return sum(s[0] for s in spans) / repeats, sum(s[1] for s in spans) / repeats


def bubbletea_verdict(doc: dict, mode: str, limits: tuple[float, float] | None) -> Result:
    """doc: bench_bubbletea_runtime's --json. ok when prompts were answered and, where judged, the step
    ratio (with / without prefill) lies within `limits`: above them prefill slows training; far below
    1 the two arms' difference is noise (prefill cannot make training faster)."""
    ratio, answered = float(doc.get("ratio", math.nan)), int(doc.get("answered", 0))
    ok = answered > 0 and math.isfinite(ratio)
    limit = "answered > 0 (ratio not judged on CPU: the ranks share cores)"
    if limits is not None:
        lo, hi = limits
        ok = ok and lo <= ratio <= hi
        limit = f"answered > 0, {lo:g} <= ratio <= {hi:g}"
    return Result(ok, f"step ratio {ratio:.3f} (with / without prefill), {answered} answered, prefill "
                      f"{doc.get('prefill_frac', 0.0):.1%} of rank time", limit)


def check_bubbletea(out: Path, mode: str, limits: tuple[float, float] | None) -> Result:
    spec, result = out / "wan2.toml", out / "bubbletea.json"
    steps, warmup = ("20", "5") if mode == "gpu" else ("3", "1")
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if mode == "cpu" else {})}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_bubbletea_runtime.py"), "--spec", str(spec),
                        "--steps", steps, "--warmup", warmup, "--rounds", "1", "--priority", "normal",
                        "--wan", "shaper", "--clients", "1", "--json", str(result)],
                       env=env, capture_output=True, text=True, timeout=300 if mode == "gpu" else 600)
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()][-8:]
    if r.returncode != 0 or not result.exists():
        return Result(False, f"the bench failed: {(r.stderr or r.stdout).strip()[-300:]}", "runs", lines)
    res = bubbletea_verdict(json.loads(result.read_text()), mode, limits)
    res.details = ["```", *lines, "```"]
    return res


def table(results: dict[str, tuple[Result, float]]) -> list[str]:
    rows = ["| check | result | measured | limit | seconds |", "| --- | --- | --- | --- | --- |"]
    for name, (res, took) in results.items():
        rows.append(f"| {name} | {'ok' if res.ok else 'FAILED'} | {res.measured} | {res.limit} | {took:.0f} |")
    return rows


def predict_verdict(row: dict, limits: tuple[float, float] | None) -> Result:
    """ok when the row holds positive, finite times (and memory) and, with limits, the prediction's
    iteration and memory errors are within them."""
    from geotrain.calibrate.gpu_measured import measured_markdown

    sane = all(isinstance(row.get(k), (int, float)) and row[k] > 0 and math.isfinite(row[k])
               for k in ("measured_s", "predicted_s", "measured_mem", "predicted_mem"))
    it = (row["predicted_s"] - row["measured_s"]) / row["measured_s"] if sane else math.nan
    mem = (row["predicted_mem"] - row["measured_mem"]) / row["measured_mem"] if sane else math.nan
    ok = sane and (limits is None or (abs(it) <= limits[0] and abs(mem) <= limits[1]))
    return Result(ok, f"iteration {it:+.1%}, memory {mem:+.1%} (predicted vs measured)",
                  "a row" if limits is None else f"<= {limits[0]:.0%}, <= {limits[1]:.0%}", [measured_markdown([row])])


def check_predict(out: Path, mode: str) -> Result:
    from geotrain.calibrate.gpu_measured import append_measured, predict_run_dir

    run = out / "single_bf16"
    if not (run / "summary.json").exists():          # `single` skipped: train its run here
        _train(_spec(out, "single_bf16", mode, "bf16", 1), run, cpu=mode == "cpu")
    row = predict_run_dir(run, "cuda" if mode == "gpu" else "cpu", f"gpu_check single ({SIZES[mode][0]})",
                          repeats=10 if mode == "gpu" else 3)
    if mode == "gpu":
        import torch  # lazy: as above

        row["device"] = torch.cuda.get_device_name(0)
    append_measured(out / "gpu_measured.json", row)
    res = predict_verdict(row, PREDICT[mode])
    res.details.append(f"\nrow added to {out / 'gpu_measured.json'}")
    return res


def _where(mode: str) -> str:
    import torch  # lazy: as above

    dev = (f"{torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} GPU(s), CUDA {torch.version.cuda}"
           if mode == "gpu" else "CPU")
    return f"torch {torch.__version__}, Python {sys.version.split()[0]}, {dev}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--out", default="runs/gpu_check")
    ap.add_argument("--skip", default="",
                    help="comma-separated checks to skip (single, wan2, units, shared, bubbletea, predict)")
    ap.add_argument("--deps", default="", help="what the set-up did (scripts/gpu_check.sh), for the report")
    ap.add_argument("--bubbletea-limits", default=None, metavar="LO,HI",
                    help="step ratio with / without prefill that passes (default: 0.9,1.05 on a GPU; not judged "
                         "on CPU)")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch  # lazy: the shell script checks the interpreter has torch before this runs

    if a.mode == "gpu" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --cpu for the CPU rehearsal)", file=sys.stderr)
        return 2
    limits = BUBBLETEA[a.mode] if a.bubbletea_limits is None else tuple(float(x) for x in a.bubbletea_limits.split(","))
    skip = set(filter(None, a.skip.split(",")))
    checks = [("single", lambda: check_single(out, a.mode)), ("wan2", lambda: check_wan2(out, a.mode)),
              ("units", lambda: check_units(a.mode)), ("shared", lambda: check_shared(out, a.mode)),
              ("bubbletea", lambda: check_bubbletea(out, a.mode, limits)),
              ("predict", lambda: check_predict(out, a.mode))]
    where = _where(a.mode)
    print(f"gpu_check ({a.mode} mode): {where}" + (f"; {a.deps}" if a.deps else ""), flush=True)
    results: dict[str, tuple[Result, float]] = {}
    for name, fn in checks:
        if name in skip:
            continue
        t0 = time.time()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 -- a failed check is reported, the others still run
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            res = Result(False, f"error: {type(e).__name__}: {last}", "runs", [f"error: {type(e).__name__}: {e}"])
        results[name] = (res, time.time() - t0)
        print(f"gpu_check {name}: {'ok' if res.ok else 'FAILED'} ({time.time() - t0:.0f} s)", flush=True)
    rows = table(results)
    print("\n".join(rows), flush=True)
    report = [f"# GPU check ({a.mode} mode)\n", where + (f"; {a.deps}" if a.deps else ""), "", *rows, ""]
    for name, (res, _) in results.items():
        report += [f"## {name}: {'ok' if res.ok else 'FAILED'}\n", *res.details, ""]
    (out / "gpu_check.md").write_text("\n".join(report) + "\n")
    failed = [n for n, (res, _) in results.items() if not res.ok]
    print(f"gpu_check: {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"(details in {out / 'gpu_check.md'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
