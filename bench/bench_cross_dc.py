"""Benchmark: the cross-DC modes trained for real over the kernel-emulated WAN, at equal token budgets.

    sudo .venv/bin/python bench/bench_cross_dc.py [--steps 384] [--dcs 2 3] [--write-table] [--only NAME] [--sweep]
    .venv/bin/python bench/bench_cross_dc.py --from-results RESULTS.json [MORE.json] --write-table [--sweep]

Part 1, loss measured (issue #28 item 4): the tiny Llama (4 layers, hidden 64, byte vocabulary) on
the built-in corpus (real text: the Python standard library's sources and docs, geotrain.data),
fp32, AdamW (lr 2e-3, 16 warm-up steps, cosine), STEPS steps of 12 sequences of 64 tokens -- the
same tokens for every mode. Two and three emulated DCs (10 ms one-way, 1 Gbit/s, 0.25 per
connection). Modes: synchronous (Atlas pipeline, one stage per DC: the same math as one process,
tests/test_runtime_pipeline.py); DiLoCo (a worker per DC, paper defaults: outer Nesterov SGD lr 0.7,
momentum 0.9) with H = 8, 32, 128; DiLoCo H = 32 with int8 outer gradients; streaming DiLoCo
(H = 32, 4 fragments, each overlapping one inner step, int4); and the synchronous pipeline
with its boundaries in bf16, fp8-e4m3 and int8. Per mode: final train loss (mean of the last 32
steps over every worker), held-out loss (the final model -- worker 0's parameters -- on 16
held-out batches of the corpus, one process), measured WAN bytes (the emulated links' counters),
wall time. --write-table writes the gaps to src/geotrain/planner/loss_table.toml, the table the
planner shows beside each mode, and the tables below into docs/CROSS_DC_MODES.md and the README
(marked sections, with the command and the load); --from-results redoes that from a run's
results.json without training again.

Part 2: per mode, the simulator's iteration time and WAN bytes for the same plan beside the
measured ones (mean step time after the first 8 steps, from losses.jsonl's clock; the analytic
cost model's "cpu" GPU is a rough number -- compare the ratios between modes).

Part 3: the planner's choice for each example spec with cross_dc = "auto" and max_loss_gap 1 %
(the table above), with the ratio of its tokens/s to the best other mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from geotrain.costs.compression import changes_numerics
from geotrain.layout.plan import LinkPlan, Plan, StagePlan
from geotrain.layout.wan_bytes import predicted_link_bytes
from geotrain.layout.workers import OuterPlan
from geotrain.models.llama import build_model
from geotrain.orchestrate.training_run import load_case
from geotrain.planner.confirm import make_plan
from geotrain.planner.modes import format_modes
from geotrain.runtime.batches import make_source
from geotrain.runtime.diloco_launch import run_workers
from geotrain.runtime.interpreter import lm_loss
from geotrain.runtime.launch import run_with_wan
from geotrain.runtime.train_config import TrainConfig, WanConfig
from geotrain.sim import simulate
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "src" / "geotrain" / "planner" / "loss_table.toml"
DOC = ROOT / "docs" / "CROSS_DC_MODES.md"
SECTIONS = {k: (f"<!-- cross-dc-{k} -->", f"<!-- /cross-dc-{k} -->") for k in ("measured", "choices", "when", "readme")}
DCS = ("a", "b", "c")
BATCH, MB, EVAL_BATCHES, TAIL = 12, 2, 16, 32
CLUSTER = 'name = "bench-cross-dc"\n' + "".join(f"""
[[datacenters]]
name = "{n}"
gpu_type = "cpu"
gpus = 2
gpus_per_node = 2
intra_node_gbps = 40
intra_dc_gbps = 40
intra_dc_latency_us = 50
""" for n in DCS) + "".join(f"""
[[wan_links]]
between = ["{x}", "{y}"]
latency_ms = 10
capacity_gbps = 1.0
per_connection_gbps = 0.25
max_connections = 8
""" for x, y in (("a", "b"), ("b", "c"), ("a", "c")))


def write_spec(tmp: Path, steps: int) -> Path:
    (tmp / "cluster.toml").write_text(CLUSTER)
    (tmp / "spec.toml").write_text(f"""name = "cross-dc-bench"
cluster = "cluster.toml"
model = "tiny"

[job]
global_batch = {BATCH}
micro_batch = {MB}
precision = "fp32"
checkpointing = "none"
sharding = "replicate"
optimizer = "adamw"
steps = {steps}
lr = 2e-3
warmup_steps = 16
eval_every = {steps}
""")
    return tmp / "spec.toml"


def modes(k: int) -> list[tuple[str, Plan]]:
    """(name, plan) of every mode on the first k DCs."""
    dcs = DCS[:k]
    units = 6                                   # tiny: embedding, 4 blocks, head
    cut = [round(i * units / k) for i in range(k + 1)]
    link = tuple(LinkPlan(a, b, connections=4) for a, b in zip(dcs, dcs[1:]))
    sync = Plan(stages=tuple(StagePlan(dc, ((cut[i], cut[i + 1]),)) for i, dc in enumerate(dcs)), dp=1,
                micro_batch=MB, num_microbatches=BATCH // MB, precision="fp32", links=link, name=f"sync-{k}")
    one = Plan(stages=(StagePlan(dcs[0], ((0, units),)),), dp=1, micro_batch=MB, num_microbatches=BATCH // MB // k,
               precision="fp32")
    workers = tuple((dc,) for dc in dcs)
    out = [(f"sync-{k}dc", sync)]
    for h in (8, 32, 128):
        out.append((f"diloco-h{h}-{k}dc", one.with_(outer=OuterPlan(workers, inner_steps=h))))
    out.append((f"diloco-h32-int8-{k}dc", one.with_(outer=OuterPlan(workers, inner_steps=32, compression="int8"))))
    out.append((f"streaming-h32-f4-int4-{k}dc", one.with_(outer=OuterPlan(workers, inner_steps=32, fragments=4,
                                                                           overlap=1, compression="int4"))))
    for codec in ("bf16", "fp8-e4m3", "int8"):
        out.append((f"boundary-{codec}-{k}dc", sync.with_(links=tuple(replace(lp, compression=codec) for lp in link))))
    return out


def train(spec_path: Path, spec, name: str, plan: Plan, steps: int, out: Path) -> dict:
    cfg = TrainConfig(out=str(out), steps=steps, progress=False, checkpoint_every=steps, trace=False,
                      wan=WanConfig(mode="kernel"))
    run = load_case(spec, cfg, plan)
    t0 = time.time()
    if plan.outer is not None:
        wan = run_workers(run, say=lambda _: None)
    else:
        wan = run_with_wan([run], out, say=lambda _: None)
    wall = time.time() - t0
    dirs = [out] + [out / f"worker{w}" for w in range(1, plan.num_workers)]
    rows = [[json.loads(x) for x in (d / "losses.jsonl").read_text().splitlines() if x.strip()] for d in dirs]
    train_loss = statistics.mean(r["loss"] for rs in rows for r in rs[-TAIL:])
    times = [r["time"] for r in rows[0]]
    step_s = (times[-1] - times[7]) / (len(times) - 8)
    crossed = json.loads((out / "wan_bytes.json").read_text()) if (out / "wan_bytes.json").exists() else {}
    return {"name": name, "train_loss": train_loss, "eval_loss": eval_loss(spec, out), "wall_s": wall,
            "step_s": step_s, "wan_bytes": sum(v["out"] for v in crossed.values()), "mode": wan.mode}


def eval_loss(spec, out: Path) -> float:
    """The final model (worker 0's parameters) on EVAL_BATCHES held-out batches, one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    dcp_to_torch_save(ckpt, out / "final.pt")
    state = torch.load(out / "final.pt")["model"]
    model = build_model(spec.model)
    model.load_state_dict(state)
    plan = Plan(stages=(StagePlan("a", ((0, 6),)),), dp=1, micro_batch=MB, num_microbatches=BATCH // MB)
    src = make_source(spec, plan, None, spec.job.seed, progress=False)
    with torch.no_grad():
        return statistics.mean(lm_loss(model(x), y).item() for x, y in map(src.eval_batch, range(EVAL_BATCHES)))


def write_table(results: list[dict], steps: int) -> None:
    lines = ["# Measured by bench/bench_cross_dc.py (do not edit by hand; add your own rows with [job] loss_table).",
             "# gap: (held-out loss - the synchronous run's) / the synchronous run's, same DCs, same tokens.", ""]
    for k in (2, 3):
        sync = next((r for r in results if r["name"] == f"sync-{k}dc"), None)
        if sync is None:
            continue
        label = (f"tiny Llama (4 layers, hidden 64), built-in corpus (Python stdlib text), {k} DCs, {steps} steps "
                 f"x {BATCH} x 64 tokens, fp32 AdamW")
        for r in results:
            if not r["name"].endswith(f"-{k}dc") or r["name"] == sync["name"]:
                continue
            p = r["plan"]
            gap = (r["eval_loss"] - sync["eval_loss"]) / sync["eval_loss"]
            tgap = (r["train_loss"] - sync["train_loss"]) / sync["train_loss"]
            if p.outer is not None:
                o = p.outer
                lines += ["[[row]]", 'mode = "diloco"', f"inner_steps = {o.inner_steps}", f"fragments = {o.fragments}",
                          f'compression = "{o.compression}"', f"workers = {k}"]
            else:
                codec = p.links[0].compression
                if not changes_numerics(codec, 4):
                    continue
                lines += ["[[row]]", 'mode = "compressed"', f'compression = "{codec}"']
            lines += [f"gap = {gap:.5f}", f"train_gap = {tgap:.5f}", f'label = "{label}"', ""]
    TABLE.write_text("\n".join(lines))
    print(f"wrote {TABLE}")


def planner_choices() -> list[str]:
    """Print, and return as markdown rows, the planner's choice per example."""
    print("\nthe planner's choice per example (cross_dc = auto, max_loss_gap 1 %, the loss table above):")
    md = ["| example | auto picks | tokens/s | vs the best other mode |", "|---|---|---:|---|"]
    for path in sorted((ROOT / "examples").glob("*.toml")):
        spec = load_spec(path)
        if len(spec.cluster.datacenters) < 2:
            continue
        spec = replace(spec, job=spec.job.model_copy(update={"cross_dc": "auto", "max_loss_gap": 0.01}))
        t0 = time.process_time()
        try:
            res = make_plan(spec)
        except Exception as e:  # noqa: BLE001 -- one line per example that cannot be planned
            print(f"  {path.name:<30} {e}")
            continue
        ok = [r for r in res.modes if r.ok]
        chosen = next(r for r in ok if r.plan is res.plan)
        rest = max((r for r in ok if r is not chosen), key=lambda r: r.tokens_per_s, default=None)
        print(f"  {path.name:<30} {chosen.label:<28} {chosen.tokens_per_s:>12,.0f} tokens/s"
              + (f"  {chosen.tokens_per_s / rest.tokens_per_s:.2f}x the best other ({rest.label})" if rest else "")
              + f"  [{time.process_time() - t0:.1f} s CPU]")
        md.append(f"| {path.name} | {chosen.label} | {chosen.tokens_per_s:,.0f} | "
                  + (f"{chosen.tokens_per_s / rest.tokens_per_s:.2f}x {rest.label} |" if rest else "- |"))
        if "--verbose" in sys.argv:
            print("\n".join(format_modes(spec, res.modes, res.plan)))
    return md


SWEEP_MODELS = ("llama2-7b", "llama2-13b", "llama2-70b")
SWEEP_LINKS = ((100.0, 5), (10.0, 20), (1.0, 50))          # Gbit/s, one-way ms


def when_each_wins(max_gap: float = 0.01) -> list[str]:
    """The planner on 2 and 4 DCs of 64 A100s, over models and links: the fastest mode overall and
    the one cross_dc = auto picks (max_loss_gap, the loss table); printed, and returned as markdown rows."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _small_clusters import write_spec as small

    print(f"\nwhen each mode wins (DCs of 64 A100-80G, global batch 256, cross_dc = auto, max_loss_gap "
          f"{max_gap:.0%}):")
    print(f"  {'DCs':>3} {'model':<11} {'link':<14} {'fastest mode':<30} {'x pipeline':>10} {'auto picks':<30} "
          f"{'x pipeline':>10}")
    md = ["| DCs | model | link (Gbit/s, one-way ms) | pipeline plan's DCs | fastest mode | fastest / pipeline "
          "| auto picks | auto / pipeline |", "|---:|---|---|---:|---|---:|---|---:|"]
    for n in (2, 4):
        for model in SWEEP_MODELS:
            for cap, lat in SWEEP_LINKS:
                names = list("ABCD"[:n])
                links = [(a, b, lat, cap, min(cap, 10.0)) for i, a in enumerate(names) for b in names[i + 1:]]
                tmp = Path(tempfile.mkdtemp(prefix="sweep-"))
                spec = small(tmp, [(x, "a100-80g", 64) for x in names], links, model,
                             {"global_batch": 256, "micro_batch": 1, "precision": "bf16", "cross_dc": "auto",
                              "max_loss_gap": max_gap})
                try:
                    res = make_plan(spec, top_k=2)
                except Exception as e:  # noqa: BLE001 -- one line per case that cannot be planned
                    print(f"  {n:>3} {model:<11} {cap:>5g} Gb/s {lat:>3g} ms  {e}")
                    md.append(f"| {n} | {model} | {cap:g}, {lat:g} | cannot be planned: {e} | | | | |")
                    continue
                ok = [r for r in res.modes if r.ok]
                fastest = max(ok, key=lambda r: r.tokens_per_s)
                chosen = next(r for r in ok if r.plan is res.plan)
                pipe = next(r for r in ok if r.mode == "pipeline")
                print(f"  {n:>3} {model:<11} {cap:>5g} Gb/s {lat:>3g} ms {fastest.label:<30} "
                      f"{fastest.tokens_per_s / pipe.tokens_per_s:>9.2f}x {chosen.label:<30} "
                      f"{chosen.tokens_per_s / pipe.tokens_per_s:>9.2f}x", flush=True)
                md.append(f"| {n} | {model} | {cap:g}, {lat:g} | {len(pipe.plan.dcs_by_rank())} | {fastest.label} | "
                          f"{fastest.tokens_per_s / pipe.tokens_per_s:.2f}x | {chosen.label} | "
                          f"{chosen.tokens_per_s / pipe.tokens_per_s:.2f}x |")
    return md


def measured_markdown(results: list[dict]) -> list[str]:
    md = ["| mode | train loss | eval loss | eval gap | WAN MB | predicted MB | step ms | predicted ms | wall s |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        md.append(f"| {r['name']} | {r['train_loss']:.4f} | {r['eval_loss']:.4f} | {r['gap']:+.2%} | "
                  f"{r['wan_bytes'] / 1e6:.2f} | {r['pred_wan'] / 1e6:.2f} | {r['step_s'] * 1e3:.1f} | "
                  f"{r['pred_step_s'] * 1e3:.1f} | {r['wall_s']:.0f} |")
    return md


def write_docs(results: list[dict], steps: int, choices: list[str], when: list[str] | None, how: str,
               planned: str) -> None:
    """The measured table, the planner's choices and (--sweep) when each mode wins, into
    docs/CROSS_DC_MODES.md; the headline gaps into the README."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _doc_sections import replace_section

    replace_section(DOC, *SECTIONS["measured"], how + ".\n\n" + "\n".join(measured_markdown(results)))
    replace_section(DOC, *SECTIONS["choices"], planned + "\n\n" + "\n".join(choices))
    if when is not None:
        replace_section(DOC, *SECTIONS["when"], planned + "\n\n" + "\n".join(when))
    gaps = ", ".join(f"{r['name']} {r['gap']:+.1%}" for r in results if not r["name"].startswith("sync"))
    replace_section(ROOT / "README.md", *SECTIONS["readme"],
                    f"Held-out loss against synchronous training at equal tokens, {steps} steps of the tiny "
                    f"model on the built-in corpus over the kernel-emulated WAN: {gaps}. {how}. The full table, "
                    "the planner's choice per example and when each mode wins: docs/CROSS_DC_MODES.md.")


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=384)
    ap.add_argument("--dcs", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--only", default=None, help="run the modes whose name contains this")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--from-results", nargs="+", default=None,
                    help="runs' results.json (merged): write the table and docs from them")
    ap.add_argument("--planner-only", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also: when each mode wins, over links, models, DCs")
    args = ap.parse_args()
    load_start, stamp = _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: list[dict] = []
    runs: list[dict] = []               # the training runs the results come from (results.json without results)
    if args.from_results:
        results, runs = merged_results(args.from_results)
        args.steps = runs[0]["steps"]
    elif not args.planner_only:
        tmp = Path(tempfile.mkdtemp(prefix="bench-cross-dc-"))
        spec_path = write_spec(tmp, args.steps)
        spec = load_spec(spec_path)
        print(f"{'mode':<28} {'train loss':>10} {'eval loss':>10} {'gap':>8} {'WAN MB':>8} {'pred MB':>8} "
              f"{'step ms':>8} {'pred ms':>8} {'wall s':>7}")
        for k in args.dcs:
            sync_eval = None
            for name, plan in modes(k):
                if args.only and args.only not in name and not name.startswith("sync"):
                    continue
                r = train(spec_path, spec, name, plan, args.steps, tmp / name)
                r["plan"] = plan
                sim = simulate(spec, plan)
                pred = predicted_link_bytes(spec, plan, args.steps, backend="gloo")
                r["pred_step_s"], r["pred_wan"] = sim.iteration_time, sum(v["out"] for v in pred.values())
                sync_eval = r["eval_loss"] if name.startswith("sync") else sync_eval
                r["gap"] = gap = (r["eval_loss"] - sync_eval) / sync_eval
                print(f"{name:<28} {r['train_loss']:>10.4f} {r['eval_loss']:>10.4f} {gap:>+8.2%} "
                      f"{r['wan_bytes'] / 1e6:>8.2f} {r['pred_wan'] / 1e6:>8.2f} {r['step_s'] * 1e3:>8.1f} "
                      f"{r['pred_step_s'] * 1e3:>8.1f} {r['wall_s']:>7.0f}", flush=True)
                results.append(r)
        runs = [{"steps": args.steps, "dcs": args.dcs, "only": args.only, "load_start": load_start,
                 "load_end": _load(), "stamp": stamp}]
        (tmp / "results.json").write_text(json.dumps({**runs[0], "results": [{**r, "plan": r["plan"].to_dict()}
                                                                             for r in results]}, indent=1))
        print(f"results: {tmp / 'results.json'}")
    if args.write_table and results:
        write_table(results, args.steps)
    choices = planner_choices()
    when = when_each_wins() if args.sweep else None
    if args.write_table and results:
        how = "Measured with " + " and ".join(
            f"`sudo .venv/bin/python bench/bench_cross_dc.py --steps {r['steps']} --dcs {' '.join(map(str, r['dcs']))}"
            + (f" --only {r['only']}" if r.get("only") else "") + f"` ({r['stamp']}, load average {r['load_start']} "
            f"at the start, {r['load_end']} at the end)" for r in runs) + f" on {os.cpu_count()} shared CPU cores"
        planned = (f"Planned {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with the loss table measured above "
                   "(`--write-table" + (" --sweep" if args.sweep else "") + "`; the planner's numbers: no load "
                   "dependence).")
        write_docs(results, args.steps, choices, when, how, planned)


def merged_results(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """The results of several runs' results.json (a mode measured twice: its first run's), grouped by
    DC count; and the runs."""
    docs = [json.loads(Path(f).read_text()) for f in paths]
    if len({d["steps"] for d in docs}) > 1:
        raise SystemExit("--from-results: those runs trained different numbers of steps")
    seen: set[str] = set()
    results = []
    for d in docs:
        for r in d["results"]:
            if r["name"] not in seen:
                seen.add(r["name"])
                results.append({**r, "plan": Plan.from_dict(r["plan"])})
    results.sort(key=lambda r: r["name"].rsplit("-", 1)[1])          # "2dc" rows, then "3dc" (stable)
    return results, [{k: v for k, v in d.items() if k != "results"} for d in docs]


if __name__ == "__main__":
    main()
