"""geotrain plan SPEC: where and how to train across these DCs, and how fast it will go."""

from __future__ import annotations

import argparse
import math

from geotrain.commands.estimate_cmd import _load_profile
from geotrain.console import human_bytes, human_seconds
from geotrain.errors import GeotrainError, SpecError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="experiment TOML file")
    p.add_argument("--out", metavar="PLAN.json", help="write the chosen plan file")
    p.add_argument("--compare", action="store_true", help="also run the baselines and print a comparison")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...",
                   help="re-plan for each value: wan.latency_ms, wan.capacity_gbps, wan.per_connection_gbps, "
                        "dc.<name>.gpus, model")
    p.add_argument("--plot", metavar="PNG", help="sweep plot file (default: sweep-<key>.png)")
    p.add_argument("--top-k", type=int, default=3, metavar="K", help="plans confirmed by simulation (default 3)")
    p.add_argument("--objective", choices=("throughput", "cost", "cost-per-token"), default="throughput",
                   help="pick among the simulated finalists the fastest (default), the lowest $/hour, or the "
                        "lowest $/1M tokens (GPU-hours at each DC's price_per_gpu_hour)")
    p.add_argument("--max-cost-per-hour", type=float, metavar="USD", help="only plans costing at most this per hour")
    p.add_argument("--min-tokens-per-s", type=float, metavar="N", help="only plans training at least this fast")
    p.add_argument("--profile", metavar="JSON", help="plan with measured per-unit times (a `geotrain profile` "
                                                    "file or the geotrain.costs.unit_times format) instead of FLOPs")
    p.add_argument("--pareto", metavar="PNG", help="draw $/1M tokens vs tokens/s of the simulated finalists, "
                                                  "the chosen plan marked")


def _fmt_gpus(d: dict[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in d.items()) or "-"


def _hourly(spec, gpus: dict[str, int]) -> float | None:
    """$/hour of these GPUs (None when a DC has no price, or for a row without GPUs)."""
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.layout.price import gpu_cost_per_hour

    return gpu_cost_per_hour(spec.cluster, gpus) if gpus else None


def _money(spec, plan, iteration_s: float) -> str:
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.layout.price import cost_per_hour, cost_per_iteration, cost_per_mtoken, egress_per_iteration

    egress = egress_per_iteration(spec, plan)
    hour = cost_per_hour(spec.cluster, plan, iteration_s, egress)
    if hour is None or not math.isfinite(iteration_s):
        return "n/a (a DC it uses has no price_per_gpu_hour)"
    return (f"${hour:,.2f}/hour, ${cost_per_iteration(spec.cluster, plan, iteration_s, egress):,.2f}/iteration, "
            f"${cost_per_mtoken(spec.cluster, plan, iteration_s, spec.model.seq_len, egress):,.3f}/1M tokens "
            f"(GPU-hours + WAN egress ${egress:,.2f}/iteration)")


def _t(x: float) -> str:
    return human_seconds(x) if math.isfinite(x) else "n/a"


def run(args: argparse.Namespace) -> int:
    # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.spec.load import load_spec

    if args.top_k < 1:
        raise GeotrainError("--top-k must be >= 1")
    spec = load_spec(args.spec)
    if args.sweep:
        return _run_sweep(spec, args)
    # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.layout.plan import save_plan
    from geotrain.planner.confirm import make_plan

    if args.pareto:
        # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.planner.whatif import check_plot_path

        check_plot_path(args.pareto, "--pareto")   # a bad path is refused before any planning

    profile = None
    if args.profile:
        # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.costs.unit_times import Profile

        profile = _load_profile(args.profile)
        try:
            Profile(profile)
        except ValueError as e:
            raise SpecError(args.profile, "profile", str(e)) from None
    res = make_plan(spec, top_k=args.top_k, objective=args.objective, max_cost_per_hour=args.max_cost_per_hour,
                    min_tokens_per_s=args.min_tokens_per_s, profile=profile)
    if args.out:   # written before anything is printed: a closed pipe must not lose the plan
        extra = {"estimate_s": res.estimate_s, "simulated_s": res.iteration_s, "lower_bound_s": res.lower_bound_s,
                 "bottleneck": res.bottleneck, "explanation": res.explanation,
                 "gpus_per_dc": res.plan.gpus_per_dc()}
        save_plan(args.out, res.plan, spec_path=str(args.spec), extra=extra, spec=spec)
    _print_plan(spec, res)
    if args.compare:
        _print_compare(spec, res)
    if args.pareto:
        # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.report.pareto import draw_pareto

        n = draw_pareto(spec, res.simulated, res.chosen_index, args.pareto, args.objective)
        print(f"\nwrote {args.pareto} ({n} simulated plans)")
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


def _print_plan(spec, res) -> None:
    p = res.plan
    cl = spec.cluster
    print(f"plan for {spec.name}: {spec.model.name} on {cl.name} ({len(cl.datacenters)} DCs, {cl.total_gpus} GPUs)")
    print(f"  dp {p.dp}  pp {p.pp}  tp {p.tp_label()}" + (f"  ep {p.ep}" if p.ep > 1 else "")
          + f"  micro-batch {p.micro_batch} x {p.num_microbatches}  schedule {p.schedule}"
          + (f" extra warm-up {list(p.extra_warmup)}" if p.extra_warmup else ""))
    print(f"  precision {p.precision}  checkpointing {p.checkpointing_label()}  sharding {p.sharding}")
    if p.outer is not None:
        o = p.outer
        print(f"  DiLoCo: {o.num_workers} workers ({' | '.join(' > '.join(dict.fromkeys(w)) for w in o.workers)}), "
              f"each the layout below; outer exchange every {o.inner_steps} steps"
              + (f" in {o.fragments} fragments, overlapping {o.overlap} step(s)" if o.fragments > 1 else "")
              + f", {o.compression}, outer Nesterov SGD lr {o.lr:g} momentum {o.momentum:g}")
    if p.replica_dcs:
        print("  region plan: DP pipelines per DC " + ", ".join(f"{d} {n}" for d, n in p.replicas_per_dc())
              + " (each pipeline inside one DC; the gradient sync crosses their links)")
    print("  stages:")
    for s, st in enumerate(p.stages):
        gpu = cl.dc(st.dc).gpu_type
        ranges = " ".join(f"{a}-{b - 1}" for a, b in st.chunks)
        print(f"    {s:3d}  {st.dc:<14} {gpu:<14} units {ranges:<12} ({len(st.units)} units)"
              + (f"  checkpointing {p.stage_checkpointing(s)}" if st.checkpointing else ""))
    for lp in p.links:
        extra = ""
        if lp.sharing == "temporal":
            extra = f", order over {len(lp.order)} pipelines, stagger {lp.stagger_s * 1e3:.2f} ms"
        print(f"  link {lp.src_dc} <-> {lp.dst_dc}: {lp.connections} connections, {lp.sharing} sharing{extra}")
    used = p.gpus_per_dc()
    print("  GPUs used: " + ", ".join(f"{d.name} {used.get(d.name, 0)}/{d.gpus}" for d in cl.datacenters))
    m = res.sim.metrics if res.sim is not None else None
    print(f"  iteration time: estimate {_t(res.estimate_s)}, simulated {_t(res.iteration_s)}")
    if m is not None:
        print(f"  tokens/s {m.tokens_per_s:,.0f}  GPU utilization {m.mean_utilization:.1%}  "
              f"WAN bytes/iteration {human_bytes(m.wan_bytes)}")
    lb = res.lower_bound_s
    if math.isfinite(lb):
        print(f"  lower bound {_t(lb)} (compute {_t(res.lower_bound_parts.get('compute', math.nan))}, "
              f"WAN {_t(res.lower_bound_parts.get('wan', math.nan))}); ratio {res.iteration_s / lb:.2f}x")
    print(f"  bottleneck: {res.bottleneck}")
    print(f"  price: {_money(spec, p, res.iteration_s)}")
    if m is not None and m.peak_memory:
        # lazy: pydantic only when the command runs (keeps `geotrain --help` fast)
        from geotrain.bubbletea.prefill_cost import headroom

        room, fit = headroom(spec, p, m.peak_memory)
        print(f"  BubbleTea: bubbles {m.bubble_fraction:.1%} of GPU time; {human_bytes(room)} free beside "
              f"training on the tightest GPU{' (per TP group)' if p.tp > 1 else ''}; inference models that fit: "
              f"{', '.join(fit) or 'none'}")
    print(f"  searched: {res.candidates_scored} candidates scored in {res.search_s:.2f} s, "
          f"{len(res.finalists)} simulated in {res.simulate_s:.2f} s")
    print("why:")
    for line in res.explanation:
        print(f"  - {line}")


def _print_compare(spec, res) -> None:
    # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.layout.price import egress_per_iteration, wan_bytes_per_link
    from geotrain.planner.confirm import evaluate_baselines

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
    print("\ncompare (simulated; dp-across-dcs analytical; $ = GPU-hours + WAN egress):")
    print(f"  {'plan':<14} {'iteration':>10} {'tokens/s':>12} {'util':>6} {'WAN/iter':>10} {'ours x':>7} "
          f"{'$/iter':>9} {'egress':>8} {'$/1M tok':>9}  GPUs per DC")
    ours = res.iteration_s
    for name, gpus, t, tok, util, wan, note, egress, tokens_it in rows:
        if math.isfinite(t):
            sp = f"{t / ours:.2f}" if name != "geotrain" else "1.00"
            per_hour = _hourly(spec, gpus)
            per_it = per_hour * t / 3600 + egress if per_hour is not None else None
            it = f"{per_it:.2f}" if per_it is not None else "-"
            mt = f"{per_it / tokens_it * 1e6:.3f}" if per_it is not None else "-"
            print(f"  {name:<14} {_t(t):>10} {tok:>12,.0f} {util:>6.1%} {human_bytes(wan):>10} {sp:>7} "
                  f"{it:>9} {egress:>8.2f} {mt:>9}  {_fmt_gpus(gpus)}" + (f"  ({note})" if note else ""))
        else:
            print(f"  {name:<14} {'n/a':>10} {'':>12} {'':>6} {'':>10} {'':>7}  {note}")
    # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.planner.confirm import make_plan
    from geotrain.planner.modes import evaluate_modes, format_modes

    modes = res.modes or evaluate_modes(spec, res, make_plan)
    print("\n".join(format_modes(spec, modes, res.plan)))


def _run_sweep(spec, args) -> int:
    # lazy: numpy, pydantic only when the command runs (keeps `geotrain --help` fast)
    from geotrain.planner.confirm import sweep
    from geotrain.planner.whatif import check_plot_path, parse_sweep, plot

    if args.out:
        raise GeotrainError("--out writes one plan file; --sweep makes one plan per value (run `geotrain plan` "
                            "without --sweep to save the plan you want)")
    key, values = parse_sweep(args.sweep)
    path = args.plot or f"sweep-{key.replace('.', '_')}.png"
    check_plot_path(path)
    rows = sweep(spec, key, values, top_k=min(args.top_k, 2))
    names = sorted({n for r in rows for n in r.baselines})
    print(f"what-if {key} for {spec.name}:")
    head = f"  {key:>22} {'plan':>10} " + " ".join(f"{n:>14}" for n in names) + "  chosen layout"
    print(head)
    for r in rows:
        cells = []
        for n in names:
            t = r.baselines.get(n, math.inf)
            cells.append(f"{t:>7.2f}s {r.speedup(n):>4.1f}x" if math.isfinite(t) else f"{'n/a':>14}")
        plan_t = f"{r.iteration_s:>8.3f}s" if math.isfinite(r.iteration_s) else f"{'n/a':>9}"
        print(f"  {r.value:>22} {plan_t:>10} " + " ".join(f"{c:>14}" for c in cells) + f"  {r.plan_summary}"
              + (f"  ({r.note})" if r.note else ""))
    plot(rows, key, path)
    print(f"plot: {path}")
    return 0
