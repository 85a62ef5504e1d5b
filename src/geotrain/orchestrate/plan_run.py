"""`geotrain plan`: where and how to train across these DCs, how fast it will go and what it costs.

The search and its simulation are `planner.confirm.make_plan`; this prints the chosen plan (stages,
links, iteration time against its lower bound, price, BubbleTea's room), the baselines beside it
(`compare`), the simulated finalists' cost against throughput (`pareto`), or a what-if sweep.
"""

from __future__ import annotations

import math

from geotrain.bubbletea.prefill_cost import headroom
from geotrain.console import human_bytes, human_seconds
from geotrain.costs.unit_times import read_unit_profile
from geotrain.errors import GeotrainError
from geotrain.layout.plan import save_plan
from geotrain.layout.price import (
    cost_per_hour,
    cost_per_iteration,
    cost_per_mtoken,
    egress_per_iteration,
    gpu_cost_per_hour,
    wan_bytes_per_link,
)
from geotrain.orchestrate.spec_check import load_experiment
from geotrain.planner.confirm import evaluate_baselines, make_plan, sweep
from geotrain.planner.modes import evaluate_modes, format_modes
from geotrain.planner.whatif import check_plot_path, parse_sweep, plot
from geotrain.report.pareto import draw_pareto


def _fmt_gpus(d: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in d.items()) or "-"


def _hourly(spec, gpus: dict[str, int]) -> float | None:
    """$/hour of these GPUs (None when a DC has no price, or for a row without GPUs)."""
    return gpu_cost_per_hour(spec.cluster, gpus) if gpus else None


def _money(spec, plan, iteration_s: float) -> str:
    egress = egress_per_iteration(spec, plan)
    hour = cost_per_hour(spec.cluster, plan, iteration_s, egress)
    if hour is None or not math.isfinite(iteration_s):
        return "n/a (a DC it uses has no price_per_gpu_hour)"
    return (f"${hour:,.2f}/hour, ${cost_per_iteration(spec.cluster, plan, iteration_s, egress):,.2f}/iteration, "
            f"${cost_per_mtoken(spec.cluster, plan, iteration_s, spec.model.seq_len, egress):,.3f}/1M tokens "
            f"(GPU-hours + WAN egress ${egress:,.2f}/iteration)")


def _t(x: float) -> str:
    return human_seconds(x) if math.isfinite(x) else "n/a"


def plan_command(spec_path: str, out: str | None = None, compare: bool = False, top_k: int = 3,
                 objective: str = "throughput", max_cost_per_hour: float | None = None,
                 min_tokens_per_s: float | None = None, min_speed: float | None = None,
                 profile_path: str | None = None, pareto: str | None = None,
                 sweep: str | None = None, plot: str | None = None, say=print) -> None:
    """`geotrain plan`: choose the plan for `spec_path` and print why (or, with `sweep`, re-plan for
    each value of one setting and plot it); `out`: write the plan file."""
    if top_k < 1:
        raise GeotrainError("--top-k must be >= 1")
    spec = load_experiment(spec_path)
    if sweep:
        return _run_sweep(spec, sweep, out, plot, top_k, say)
    if pareto:
        check_plot_path(pareto, "--pareto")   # a bad path is refused before any planning
    profile = read_unit_profile(profile_path) if profile_path else None
    res = make_plan(spec, top_k=top_k, objective=objective, max_cost_per_hour=max_cost_per_hour,
                    min_tokens_per_s=min_tokens_per_s, min_speed=min_speed, profile=profile)
    if out:   # written before anything is printed: a closed pipe must not lose the plan
        extra = {"estimate_s": res.estimate_s, "simulated_s": res.iteration_s, "lower_bound_s": res.lower_bound_s,
                 "bottleneck": res.bottleneck, "explanation": res.explanation,
                 "gpus_per_dc": res.plan.gpus_per_dc()}
        save_plan(out, res.plan, spec_path=str(spec_path), extra=extra, spec=spec)
    _print_plan(spec, res, say)
    if compare:
        _print_compare(spec, res, say)
    if pareto:
        n = draw_pareto(spec, res.simulated, res.chosen_index, pareto, objective)
        say(f"\nwrote {pareto} ({n} simulated plans)")
    if out:
        say(f"\nwrote {out}")


def _print_plan(spec, res, say) -> None:
    p = res.plan
    cl = spec.cluster
    say(f"plan for {spec.name}: {spec.model.name} on {cl.name} ({len(cl.datacenters)} DCs, {cl.total_gpus} GPUs)")
    say(f"  dp {p.dp}  pp {p.pp}  tp {p.tp_label()}" + (f"  ep {p.ep}" if p.ep > 1 else "")
        + f"  micro-batch {p.micro_batch} x {p.num_microbatches}  schedule {p.schedule}"
        + (f" extra warm-up {list(p.extra_warmup)}" if p.extra_warmup else ""))
    say(f"  precision {p.precision}  checkpointing {p.checkpointing_label()}  sharding {p.sharding}")
    if p.outer is not None:
        o = p.outer
        say(f"  DiLoCo: {o.num_workers} workers ({' | '.join(' > '.join(dict.fromkeys(w)) for w in o.workers)}), "
            f"each the layout below; outer exchange every {o.inner_steps} steps"
            + (f" in {o.fragments} fragments, overlapping {o.overlap} step(s)" if o.fragments > 1 else "")
            + f", {o.compression}, outer Nesterov SGD lr {o.lr:g} momentum {o.momentum:g}")
    if p.replica_dcs:
        say("  region plan: DP pipelines per DC " + ", ".join(f"{d} {n}" for d, n in p.replicas_per_dc())
            + " (each pipeline inside one DC; the gradient sync crosses their links)")
    say("  stages:")
    for s, st in enumerate(p.stages):
        gpu = cl.dc(st.dc).gpu_type
        ranges = " ".join(f"{a}-{b - 1}" for a, b in st.chunks)
        say(f"    {s:3d}  {st.dc:<14} {gpu:<14} units {ranges:<12} ({len(st.units)} units)"
            + (f"  checkpointing {p.stage_checkpointing(s)}" if st.checkpointing else ""))
    for lp in p.links:
        extra = ""
        if lp.sharing == "temporal":
            extra = f", order over {len(lp.order)} pipelines, stagger {lp.stagger_s * 1e3:.2f} ms"
        say(f"  link {lp.src_dc} <-> {lp.dst_dc}: {lp.connections} connections, {lp.sharing} sharing{extra}")
    used = p.gpus_per_dc()
    say("  GPUs used: " + ", ".join(f"{d.name} {used.get(d.name, 0)}/{d.gpus}" for d in cl.datacenters))
    m = res.sim.metrics if res.sim is not None else None
    say(f"  iteration time: estimate {_t(res.estimate_s)}, simulated {_t(res.iteration_s)}")
    if m is not None:
        say(f"  tokens/s {m.tokens_per_s:,.0f}  GPU utilization {m.mean_utilization:.1%}  "
            f"WAN bytes/iteration {human_bytes(m.wan_bytes)}")
    lb = res.lower_bound_s
    if math.isfinite(lb):
        say(f"  lower bound {_t(lb)} (compute {_t(res.lower_bound_parts.get('compute', math.nan))}, "
            f"WAN {_t(res.lower_bound_parts.get('wan', math.nan))}); ratio {res.iteration_s / lb:.2f}x")
    say(f"  bottleneck: {res.bottleneck}")
    say(f"  price: {_money(spec, p, res.iteration_s)}")
    if m is not None and m.peak_memory:
        room, fit = headroom(spec, p, m.peak_memory)
        say(f"  BubbleTea: bubbles {m.bubble_fraction:.1%} of GPU time; {human_bytes(room)} free beside "
            f"training on the tightest GPU{' (per TP group)' if p.tp > 1 else ''}; inference models that fit: "
            f"{', '.join(fit) or 'none'}")
    say(f"  searched: {res.candidates_scored} candidates scored in {res.search_s:.2f} s, "
        f"{len(res.finalists)} simulated in {res.simulate_s:.2f} s")
    say("why:")
    for line in res.explanation:
        say(f"  - {line}")


def _print_compare(spec, res, say) -> None:
    seq = spec.model.seq_len
    rows = [("geotrain", res.plan.gpus_per_dc(), res.iteration_s,
             res.sim.metrics.tokens_per_s if res.sim else math.nan,
             res.sim.metrics.mean_utilization if res.sim else math.nan,
             sum(wan_bytes_per_link(spec, res.plan).values()), "", egress_per_iteration(spec, res.plan),
             res.plan.global_batch * seq)]
    for b in evaluate_baselines(spec):
        egress = egress_per_iteration(spec, b.plan) if b.plan is not None else b.egress_usd
        # tokens per iteration as layout.price.cost_per_mtoken counts them: the plan's batch (an
        # analytical row without a plan trains the job's)
        batch = b.plan.global_batch if b.plan is not None else spec.job.global_batch
        rows.append((b.name, b.gpus_per_dc, b.iteration_s, b.tokens_per_s, b.utilization, b.wan_bytes, b.note,
                     egress, batch * seq))
    say("\ncompare (simulated; dp-across-dcs analytical; $ = GPU-hours + WAN egress):")
    say(f"  {'plan':<14} {'iteration':>10} {'tokens/s':>12} {'util':>6} {'WAN/iter':>10} {'ours x':>7} "
        f"{'$/iter':>9} {'egress':>8} {'$/1M tok':>9}  GPUs per DC")
    ours = res.iteration_s
    for name, gpus, t, tok, util, wan, note, egress, tokens_it in rows:
        if math.isfinite(t):
            sp = f"{t / ours:.2f}" if name != "geotrain" else "1.00"
            per_hour = _hourly(spec, gpus)
            per_it = per_hour * t / 3600 + egress if per_hour is not None else None
            it = f"{per_it:.2f}" if per_it is not None else "-"
            mt = f"{per_it / tokens_it * 1e6:.3f}" if per_it is not None else "-"
            say(f"  {name:<14} {_t(t):>10} {tok:>12,.0f} {util:>6.1%} {human_bytes(wan):>10} {sp:>7} "
                f"{it:>9} {egress:>8.2f} {mt:>9}  {_fmt_gpus(gpus)}" + (f"  ({note})" if note else ""))
        else:
            say(f"  {name:<14} {'n/a':>10} {'':>12} {'':>6} {'':>10} {'':>7}  {note}")
    modes = res.modes or evaluate_modes(spec, res, make_plan)
    say("\n".join(format_modes(spec, modes, res.plan)))


def _run_sweep(spec, text: str, out: str | None, plot_path: str | None, top_k: int, say) -> None:
    if out:
        raise GeotrainError("--out writes one plan file; --sweep makes one plan per value (run `geotrain plan` "
                            "without --sweep to save the plan you want)")
    key, values = parse_sweep(text)
    path = plot_path or f"sweep-{key.replace('.', '_')}.png"
    check_plot_path(path)
    rows = sweep(spec, key, values, top_k=min(top_k, 2))
    names = sorted({n for r in rows for n in r.baselines})
    say(f"what-if {key} for {spec.name}:")
    head = f"  {key:>22} {'plan':>10} " + " ".join(f"{n:>14}" for n in names) + "  chosen layout"
    say(head)
    for r in rows:
        cells = []
        for n in names:
            t = r.baselines.get(n, math.inf)
            cells.append(f"{t:>7.2f}s {r.speedup(n):>4.1f}x" if math.isfinite(t) else f"{'n/a':>14}")
        plan_t = f"{r.iteration_s:>8.3f}s" if math.isfinite(r.iteration_s) else f"{'n/a':>9}"
        say(f"  {r.value:>22} {plan_t:>10} " + " ".join(f"{c:>14}" for c in cells) + f"  {r.plan_summary}"
            + (f"  ({r.note})" if r.note else ""))
    plot(rows, key, path)
    say(f"plot: {path}")
