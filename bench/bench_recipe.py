"""The recipe's benchmark (not a test): it learns like a reference; what clipping costs; how fast data tokenizes.

    .venv/bin/python bench/bench_recipe.py [--size small|25m] [--steps N] [--wan kernel|shaper|off]
        [--skip-equality] [--skip-clip [--simulated]] [--skip-tokenize] [--corpus-mb 100] [--out DIR]

1. equality: a byte-level Llama (`--size 25m`: 25.6 M parameters, 8 x 512, seq 256,
   8 sequences a step; `small`: 3.3 M,
   4 x 256, seq 128 -- what a 2-core machine trains in minutes) on real text built on the machine
   (every module of the Python standard library as JSONL: source and docstrings), with warm-up,
   cosine decay, clipping, weight decay and a held-out eval, trained by `geotrain train` on
   pp=2 x dp=2 across two emulated DCs (tiny_2dc's cluster) in fp32 -- against a plain
   single-process loop: `torch.optim.AdamW` over two groups (matrices decayed), `clip_grad_norm_`,
   the same lr function and the same batches -- and against that loop with each step's micro-batches
   summed in reverse order (the noise floor: fp32 rounding that training amplifies; on the 25 M model
   it passes 1e-5 within a few dozen steps). Prints the curves side by side and the largest
   relative differences, and draws bench/data/recipe_curve.png (the README's picture).
2. clip cost: tiny_2dc (pp2 x dp2, 10 ms WAN) over the emulated WAN with clipping, the measured waits
   of the gradient norm's exchange per iteration and stage (the runtime's recv_wait events of stage -1)
   beside the simulator's (its norm receives), and step time with and without clipping, runs interleaved A B A B;
   then the simulated cost on the examples (period between iteration starts, and iteration window).
3. tokenize: a `--corpus-mb` JSONL corpus (the standard library's sources repeated) tokenized into the
   token cache by the byte tokenizer and by a BPE tokenizer.json trained here: MB/s, tokens/s,
   CPU seconds per wall second (cores used) and the CPU seconds of each busy thread.
Each number is measured in this run; say the machine's load beside any you quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "tiny_2dc.toml"
SIZES = {   # layers, hidden, heads, ffn, seq_len, global batch
    "small": (4, 256, 4, 688, 128, 8),
    "25m": (8, 512, 8, 1376, 256, 8),
}
PY = sys.executable


def build_corpus(path: Path) -> int:
    """The standard library's modules as JSONL records {"text": source}; returns the bytes written."""
    from geotrain.data import stdlib_files

    n = 0
    with open(path, "w") as f:
        for p in stdlib_files():
            try:
                text = p.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                n += len(line)
    return n


def write_spec(tmp: Path, size: str, steps: int, data: Path, clip: float = 1.0, name: str = "recipe") -> Path:
    layers, hidden, heads, ffn, seq, batch = SIZES[size]
    path = tmp / f"{name}.toml"
    path.write_text(f"""name = "{name}"
cluster = "{CLUSTER}"
[model]
name = "bytes-{size}"
layers = {layers}
hidden = {hidden}
heads = {heads}
kv_heads = {heads}
ffn = {ffn}
vocab = 256
seq_len = {seq}
[job]
global_batch = {batch}
micro_batch = {batch // 4}
precision = "fp32"
checkpointing = "none"
sharding = "zero3"
schedule = "1f1b"
pp = 2
dp = 2
steps = {steps}
lr = 1e-3
warmup_steps = {max(1, steps // 10)}
decay = "cosine"
min_lr_ratio = 0.1
weight_decay = 0.1
grad_clip = {clip}
eval_every = {max(1, steps // 5)}
eval_batches = 2
eval_split = 0.02
data = "{data}"
""")
    return path


def reference_loop(spec_path: Path, steps: int,
                   reverse: bool = False) -> tuple[list[float], list[float], dict[int, float]]:
    """The textbook loop: one process, the whole model, AdamW, clip_grad_norm_, lr_at, the same batches.
    `reverse` accumulates each step's micro-batches in the opposite order: the same arithmetic with the
    fp32 sums in another order -- how far two correct runs drift apart (the noise floor)."""
    from geotrain.data import open_batches
    from geotrain.models.llama import build_model
    from geotrain.runtime.interpreter import lm_loss
    from geotrain.spec.load import load_spec

    spec = load_spec(spec_path)
    job = spec.job
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as each rank runs (OMP_NUM_THREADS=1): spinning threads on a loaded box crawl
    torch.manual_seed(job.seed)
    model = build_model(spec.model)
    # By hand, as nanoGPT groups them: weight matrices decayed, the embedding and the norms not.
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and not n.endswith("tok.weight")]
    rest = [p for n, p in named if not (p.dim() >= 2 and not n.endswith("tok.weight"))]
    groups = [{"params": decay, "weight_decay": job.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=job.lr, betas=tuple(job.betas), eps=job.eps)

    def lr(step: int) -> float:     # linear warm-up, then cosine to lr x min_lr_ratio at job.steps
        if step <= job.warmup_steps:
            return job.lr * step / job.warmup_steps
        p = min(1.0, (step - job.warmup_steps) / (job.steps - job.warmup_steps))
        low = job.lr * job.min_lr_ratio
        return low + (job.lr - low) * 0.5 * (1 + math.cos(math.pi * p))

    data = open_batches(job.data, seq_len=spec.model.seq_len, global_batch=job.global_batch, seed=job.seed,
                        holdout=job.eval_split, progress=False)
    micro = job.global_batch // job.micro_batch
    losses, norms, evals = [], [], {}
    for step in range(1, steps + 1):
        x, y = data.global_batch(step - 1)
        total = 0.0
        pairs = list(zip(x.split(job.micro_batch), y.split(job.micro_batch)))
        for xs, ys in reversed(pairs) if reverse else pairs:
            loss = lm_loss(model(xs), ys) / micro
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), job.grad_clip)))
        for g in opt.param_groups:
            g["lr"] = lr(step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if step % job.eval_every == 0 or step == steps:
            with torch.no_grad():
                evals[step] = sum(lm_loss(model(ex), ey).item() for ex, ey in map(data.eval_batch, range(
                    job.eval_batches))) / job.eval_batches
    torch.set_num_threads(threads)
    return losses, norms, evals


def train(spec: Path, out: Path, wan: str, steps: int | None = None) -> float:
    cmd = [PY, "-m", "geotrain", "train", str(spec), "--out", str(out), "--wan", wan, "--no-progress",
           "--checkpoint-every", "0"] + (["--steps", str(steps)] if steps else [])
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t0


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def equality(tmp: Path, size: str, steps: int, wan: str) -> None:
    corpus = tmp / "stdlib.jsonl"
    nbytes = build_corpus(corpus)
    spec = write_spec(tmp, size, steps, corpus)
    print(f"\n== 1. equality: {size} model, {steps} steps, corpus {nbytes / 2**20:.1f} MB of standard-library "
          f"source (JSONL), pp=2 x dp=2 over --wan {wan}, fp32 ==", flush=True)
    # Side by side: the run's 4 ranks, the reference, and the reference with its micro-batches summed in
    # reverse order (the noise floor: two correct fp32 runs differ only in the order of their sums).
    t0 = time.time()
    run = subprocess.Popen([PY, "-m", "geotrain", "train", str(spec), "--out", str(tmp / "run"), "--wan", wan,
                            "--no-progress", "--checkpoint-every", "0"], stdout=subprocess.DEVNULL)
    floor_path = tmp / "reference_reversed.json"
    floor = multiprocessing.get_context("fork").Process(target=_reference_to_file, args=(spec, steps, floor_path))
    floor.start()
    ref_loss, ref_norm, ref_eval = reference_loop(spec, steps)
    t_ref = time.time() - t0
    floor.join()
    if run.wait() != 0 or floor.exitcode != 0:
        raise SystemExit(f"geotrain train exited {run.returncode}, the reversed reference {floor.exitcode}")
    t_run = time.time() - t0
    (tmp / "reference.json").write_text(json.dumps({"loss": ref_loss, "grad_norm": ref_norm, "eval": ref_eval}))
    report_equality(tmp, size, steps, rows(tmp / "run"), ref_loss, ref_norm, ref_eval,
                    json.loads(floor_path.read_text()))
    print(f"wall, run side by side: geotrain train {t_run:.0f} s (4 ranks), reference loops {t_ref:.0f} s "
          f"(1 process each)")


def _reference_to_file(spec: Path, steps: int, path: Path) -> None:
    loss, norm, evals = reference_loop(spec, steps, reverse=True)
    path.write_text(json.dumps({"loss": loss, "grad_norm": norm, "eval": evals}))


def _first_over(rel: list[float], bound: float = 1e-5) -> str:
    return next((str(i + 1) for i, r in enumerate(rel) if r > bound), "none")


def report_equality(tmp: Path, size: str, steps: int, got: list[dict], ref_loss: list[float],
                    ref_norm: list[float], ref_eval: dict, floor: dict) -> None:
    """Both curves side by side, the largest differences, and the same for the noise floor."""
    ref_eval = {int(k): v for k, v in ref_eval.items()}
    loss = [r["loss"] for r in got]
    rel = [abs(a - b) / abs(b) for a, b in zip(loss, ref_loss)]
    frel = [abs(a - b) / abs(b) for a, b in zip(floor["loss"], ref_loss)]
    nrel = [abs(r["grad_norm"] - b) / b for r, b in zip(got, ref_norm)]
    evals = {r["step"]: r["eval_loss"] for r in got if r.get("eval_loss") is not None}
    print(f"{'step':>5} {'geotrain':>10} {'reference':>10} {'rel diff':>9} {'floor':>9} {'lr':>9} {'grad norm':>10} "
          f"{'eval':>8}")
    for i in sorted({0, *range(0, steps, max(1, steps // 12)), steps - 1}):
        e = evals.get(i + 1)
        print(f"{i + 1:>5} {loss[i]:>10.5f} {ref_loss[i]:>10.5f} {rel[i]:>9.1e} {frel[i]:>9.1e} {got[i]['lr']:>9.2e} "
              f"{got[i]['grad_norm']:>10.4f} {'' if e is None else f'{e:>8.4f}'}")
    clipped = sum(1 for n in ref_norm if n > 1.0)
    eval_rel = max(abs(evals[s] - ref_eval[s]) / ref_eval[s] for s in ref_eval)
    floor_evals = {int(k): v for k, v in floor["eval"].items()}
    floor_eval = max(abs(floor_evals[s] - ref_eval[s]) / ref_eval[s] for s in ref_eval)
    print(f"max relative difference over {steps} steps: loss {max(rel):.2e}, grad norm {max(nrel):.2e}, "
          f"held-out loss {eval_rel:.2e}; {clipped} of {steps} steps clipped; held-out loss "
          f"{ref_eval[min(ref_eval)]:.3f} -> {ref_eval[max(ref_eval)]:.3f}")
    print(f"noise floor, the reference against itself with each step's micro-batches summed in reverse order: "
          f"loss {max(frel):.2e}, held-out loss {floor_eval:.2e}; first step over 1e-5: geotrain "
          f"{_first_over(rel)}, reversed reference {_first_over(frel)}; median over the steps: geotrain "
          f"{statistics.median(rel):.1e}, reversed {statistics.median(frel):.1e}")
    draw(got, ref_loss, evals, rel, frel, ROOT / "bench" / "data" / "recipe_curve.png", size)


def draw(got: list[dict], ref: list[float], evals: dict[int, float], rel: list[float], floor: list[float],
         path: Path, size: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 3.6))
    xs = [r["step"] for r in got]
    a.plot(xs, [r["loss"] for r in got], lw=2.5, alpha=0.5, label="geotrain pp2 x dp2, 2 emulated DCs")
    a.plot(xs, ref, lw=1, color="black", ls="--", label="single process: AdamW + clip_grad_norm_")
    a.plot(list(evals), list(evals.values()), "o-", color="tab:orange", label="held-out loss")
    a.set_xlabel("step")
    a.set_ylabel("loss (nats / byte)")
    a.legend(fontsize=8)
    a.set_title(f"{size} byte-level Llama on standard-library source, fp32", fontsize=9)
    b.plot(xs, [r["lr"] for r in got], color="tab:green")
    b.set_ylabel("learning rate", color="tab:green")
    b2 = b.twinx()
    b2.plot(xs, [r["grad_norm"] for r in got], color="tab:red", lw=0.8)
    b2.axhline(1.0, color="tab:red", ls=":", lw=0.8)
    b2.set_ylabel("gradient norm (clip at 1.0)", color="tab:red")
    b.set_xlabel("step")
    b.set_title("warm-up + cosine; the gradient norm before clipping", fontsize=9)
    c.semilogy(xs, [max(r, 1e-9) for r in rel], lw=1, label="geotrain vs reference")
    c.semilogy(xs, [max(r, 1e-9) for r in floor], lw=1, color="tab:gray", label="reference vs itself, sums reversed")
    c.axhline(1e-5, color="black", ls=":", lw=0.8)
    c.set_xlabel("step")
    c.set_ylabel("relative difference of the loss")
    c.legend(fontsize=8)
    c.set_title("fp32 rounding, amplified by training: the noise floor", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"curve: {path}")


def _norm_wait(trace_path: Path, source: str, plan=None) -> float | dict[int, float]:
    """Mean per iteration and rank of the waits of the gradient norm's exchange (steady state): the
    stage's sum and the partial from the stages after it, then the total; with `plan`, per stage."""
    from geotrain.trace.schema import Trace

    tr = Trace.read_jsonl(trace_path)
    its = sorted({e.iteration for e in tr.events})
    keep = set(its[1:]) if len(its) > 1 else set(its)
    if source == "measured":     # the runtime records the norm waits as recv_waits of stage -1
        waits = [e for e in tr.events if e.kind == "recv_wait" and e.stage == -1 and e.iteration in keep]
    else:                        # the simulator's norm receives carry micro-batch -1
        waits = [e for e in tr.events if e.kind == "recv_wait" and e.mb == -1 and e.iteration in keep]
    if plan is None:
        return sum(e.end - e.start for e in waits) / max(1, len(keep) * tr.num_ranks)
    per = {}
    for s in range(plan.pp):
        ranks = {r for r in range(plan.num_ranks) if plan.coords(r)[0] == s}
        per[s] = sum(e.end - e.start for e in waits if e.rank in ranks) / max(1, len(keep) * len(ranks))
    return per


def clip_simulated() -> None:
    """What the simulator says clipping's exchange costs on the examples: the period between
    iteration starts (steady state) and the iteration window (to the last optimizer step)."""
    from geotrain.planner.manual import plan_from_job
    from geotrain.sim import simulate
    from geotrain.spec.load import load_spec

    print("simulated, clipping on vs off (4 iterations): period between iteration starts | iteration window")
    for name in ("tiny_2dc", "llama2_7b_a100_3dc", "llama2_70b_h100_3dc", "gpt3_175b_h100_3dc"):
        spec = load_spec(ROOT / "examples" / f"{name}.toml")
        plan = plan_from_job(spec)
        out = []
        for clip in (spec.job.grad_clip or 1.0, 0.0):
            s = spec if clip else dataclasses.replace(spec, job=spec.job.model_copy(update={"grad_clip": 0.0}))
            res = simulate(s, plan, iterations=4)
            first: dict[int, float] = {}
            for e in res.trace.events:
                if e.kind == "forward" and e.rank == plan.rank(0, 0):
                    first[e.iteration] = min(first.get(e.iteration, 1e99), e.start)
            its = sorted(first)
            out.append(((first[its[-1]] - first[its[0]]) / (len(its) - 1), res.metrics.iteration_time))
        (p_on, w_on), (p_off, w_off) = out
        print(f"  {name:>22} (pp {plan.pp} x dp {plan.dp}): {1e3 * p_off:9.2f} -> {1e3 * p_on:9.2f} ms "
              f"({1e3 * (p_on - p_off):+.2f}) | {1e3 * w_off:9.2f} -> {1e3 * w_on:9.2f} ms "
              f"({1e3 * (w_on - w_off):+.2f})")


def _compute(trace_path: Path) -> float:
    """Forward and backward seconds per iteration and rank (steady state)."""
    from geotrain.trace.schema import Trace

    tr = Trace.read_jsonl(trace_path)
    its = set(sorted({e.iteration for e in tr.events})[2:])
    busy = sum(e.end - e.start for e in tr.events if e.kind.startswith(("forward", "backward")) and e.iteration in its)
    return busy / max(1, len(its) * tr.num_ranks)


def clip_cost(tmp: Path, wan: str, reps: int) -> None:
    from geotrain.planner.manual import plan_from_job
    from geotrain.sim import simulate
    from geotrain.spec.load import load_spec

    base = (ROOT / "examples" / "tiny_2dc.toml").read_text()
    base = base.replace('cluster = "clusters/', f'cluster = "{CLUSTER.parent}/')
    specs = {}
    for clip in (1e-3, 0.0):        # 1e-3: every step clipped (tiny's norms are ~0.5-3)
        p = tmp / f"clip{clip}.toml"
        p.write_text(base.replace("[job]\n", f"[job]\ngrad_clip = {clip}\n"))
        specs[clip] = p
    spec = load_spec(specs[1e-3])
    plan = plan_from_job(spec)
    print(f"\n== 2. clipping's cost per iteration: tiny_2dc pp2 x dp2 over --wan {wan} (10 ms one way), "
          f"{reps} rounds interleaved ==", flush=True)
    step_s: dict[float, list[float]] = {1e-3: [], 0.0: []}
    compute: dict[float, list[float]] = {1e-3: [], 0.0: []}
    waits = []
    for r in range(reps):
        for clip, path in specs.items():
            out = tmp / f"clip-run-{clip}-{r}"
            train(path, out, wan, steps=12)
            step_s[clip].append(statistics.median(x["step_time_s"] for x in rows(out)[2:]))
            compute[clip].append(_compute(out / "measured_trace.jsonl"))
            if clip:
                waits.append(_norm_wait(out / "measured_trace.jsonl", "measured", plan))
    res = simulate(spec, plan, iterations=4)
    res.trace.write_jsonl(tmp / "clip-simulated.jsonl")
    pred = _norm_wait(tmp / "clip-simulated.jsonl", "simulated", plan)
    on, off = statistics.median(step_s[1e-3]), statistics.median(step_s[0.0])
    print("the norm exchange's waits per iteration and rank (stage 0: its stage's sum and the partial from the "
          "last stage; the last stage: its sum and the total)")
    for s in range(plan.pp):
        got = [w[s] for w in waits]
        print(f"  stage {s}: measured {1e3 * statistics.median(got):.2f} ms (rounds: "
              f"{', '.join(f'{1e3 * w:.2f}' for w in got)}), simulated {1e3 * pred[s]:.2f} ms")
    print(f"median step time: clipping {1e3 * on:.1f} ms, none {1e3 * off:.1f} ms (ratio {on / off:.3f}; rounds "
          f"{', '.join(f'{1e3 * a:.0f}/{1e3 * b:.0f}' for a, b in zip(step_s[1e-3], step_s[0.0]))} ms)")
    print("forward + backward per iteration and rank (how fast the CPU was in each run): clipping "
          + ", ".join(f"{1e3 * c:.0f}" for c in compute[1e-3]) + " ms, none "
          + ", ".join(f"{1e3 * c:.0f}" for c in compute[0.0]) + " ms")
    clip_simulated()


def tokenize(tmp: Path, mb: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from geotrain.data import corpus as corpus_module
    from geotrain.data import load_corpus
    from geotrain.data.tokenizer import HFTokenizer

    src = tmp / "stdlib.jsonl"
    if not src.exists():
        build_corpus(src)
    one = src.read_bytes()
    big = tmp / "corpus" / "big.jsonl"
    big.parent.mkdir(exist_ok=True)
    with open(big, "wb") as f:
        written = 0
        while written < mb * 2**20:
            f.write(one)
            written += len(one)
    size = big.stat().st_size
    tok_dir = tmp / "bpe"
    tok_dir.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = [json.loads(x)["text"] for x in one.decode().splitlines()[:400]]
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<s>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    print(f"\n== 3. tokenizing a {size / 2**20:.0f} MB JSONL corpus into the token cache ({os.cpu_count()} cores) ==",
          flush=True)
    for name, tk in (("bytes", None), ("BPE 8192 (tokenizers)", HFTokenizer(tok_dir))):
        os.environ["GEOTRAIN_CACHE_DIR"] = str(tmp / f"cache-{name.split()[0]}")
        corpus_module._CACHE.clear()
        r0, t0, th0 = resource.getrusage(resource.RUSAGE_SELF), time.time(), _thread_cpu()
        c = load_corpus(big, tokenizer=tk, progress=False)
        wall = time.time() - t0
        r1, th1 = resource.getrusage(resource.RUSAGE_SELF), _thread_cpu()
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        busy = sorted((th1[t] - th0.get(t, 0.0) for t in th1), reverse=True)
        busy = [b for b in busy if b >= 0.05 * cpu]
        print(f"{name:>22}: {size / 2**20 / wall:7.1f} MB/s, {len(c) / wall / 1e6:6.2f} M tokens/s "
              f"({len(c) / 1e6:.1f} M tokens, {c.documents:,} documents, {wall:.1f} s, "
              f"{cpu / wall:.2f} CPU-s per s; {cpu:.1f} CPU-s over {len(busy)} threads: "
              f"{', '.join(f'{b:.1f}' for b in busy)})")


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of each of this process's threads (Linux): how the work spreads over cores,
    which CPU-s per wall second cannot show on a loaded machine."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(t)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--wan", default="kernel", choices=["kernel", "shaper", "off"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--corpus-mb", type=int, default=100)
    ap.add_argument("--skip-equality", action="store_true")
    ap.add_argument("--skip-clip", action="store_true")
    ap.add_argument("--skip-tokenize", action="store_true")
    ap.add_argument("--simulated", action="store_true", help="with --skip-clip: only the simulated clipping cost")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="bench-recipe-") as d:
        tmp = args.out or Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("GEOTRAIN_CACHE_DIR", str(tmp / "cache"))
        if not args.skip_equality:
            equality(tmp, args.size, args.steps, args.wan)
        if not args.skip_clip:
            clip_cost(tmp, args.wan, args.reps)
        elif args.simulated:
            clip_simulated()
        if not args.skip_tokenize:
            tokenize(tmp, args.corpus_mb)
    print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
