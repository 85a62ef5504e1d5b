"""`geotrain estimate`: the cost model's view of a job, unit by unit and stage by stage.

It takes the layout the job pins (plan_from_job: fixed pp/dp, even split, stages in DC order)
and prints what the cost model predicts for it, so a user can see where time and memory go
before planning or simulating: FLOPs, parameters and saved activations per unit, compute time
per micro-batch and memory per GPU per stage, and whether each stage fits its GPUs.
"""

from __future__ import annotations

from geotrain.console import format_table, human_bytes, human_rate, human_seconds
from geotrain.costs import CostModel
from geotrain.costs.unit_times import read_unit_profile
from geotrain.errors import SpecError
from geotrain.layout.peaks import stage_peaks
from geotrain.orchestrate.spec_check import load_experiment
from geotrain.planner.manual import plan_from_job
from geotrain.schedule.builders import schedule_for_plan


def _stage_peaks(spec, plan) -> tuple[list[tuple], str]:
    """Per stage (peak, micro-batches held, of them between B and W) under the plan's schedule,
    as `geotrain train` predicts it (layout.peaks.stage_peaks)."""
    try:
        return stage_peaks(spec, plan, schedule_for_plan(plan)), ""
    except ValueError as e:  # fall back to 1F1B's count rather than refuse to estimate
        out = []
        for s, st in enumerate(plan.stages):
            held = min(plan.num_microbatches, plan.pp - s)
            cost = _cost(spec, plan, s)
            gpu = spec.cluster.gpu(spec.cluster.dc(st.dc).gpu_type)
            out.append((cost.stage_memory(st.units, gpu, plan.micro_batch, held, plan.sharding, plan.dp,
                                          plan.stage_tp(s), num_microbatches=plan.num_microbatches), held, 0.0))
        return out, f"(schedule {plan.schedule!r} not buildable: {e}; 1F1B in-flight counts used)"


def _cost(spec, plan, stage: int, profile: dict | None = None):
    return CostModel(spec.model, precision=plan.precision, checkpointing=plan.stage_checkpointing(stage),
                     optimizer=spec.job.optimizer, profile=profile, ep=plan.ep)


def _count(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-6 else f"{x:.2f}"


def _left_to_planner(job) -> list[str]:
    """Job fields that are unset or "auto": estimate fills them with plan_from_job's defaults."""
    out = [k for k in ("pp", "dp") if getattr(job, k) is None]
    out += [k for k in ("micro_batch", "schedule", "checkpointing", "sharding") if getattr(job, k) == "auto"]
    return out


def _unit_groups(model, chunks):
    """(label, kind, first unit, count) rows: embedding and head alone, blocks grouped."""
    rows = []
    for a, b in chunks:
        if a == 0:
            rows.append(("0", "embedding", 0, 1))
        lo, hi = max(a, 1), min(b, model.layers + 1)
        if hi > lo:
            rows.append((f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo), "block", lo, hi - lo))
        if b == model.num_units:
            rows.append((str(model.layers + 1), "head", model.layers + 1, 1))
    return rows


def print_estimate(spec_path: str, profile_path: str | None = None, say=print) -> None:
    """The cost model's view of the layout `spec_path`'s job pins (see the module docstring)."""
    spec = load_experiment(spec_path)
    plan = plan_from_job(spec, virtual_per_stage=2 if spec.job.schedule == "interleaved" else 1, fit=False)
    profile = read_unit_profile(profile_path) if profile_path else None
    try:
        stage_cost = [_cost(spec, plan, s, profile) for s in range(plan.pp)]
    except ValueError as e:
        raise SpecError(profile_path or spec_path, "profile", str(e)) from None
    _say_job(spec, plan, stage_cost[0], profile, spec_path, say)
    _say_units(spec, plan, stage_cost, say)
    _say_stage_times(spec, plan, stage_cost, say)
    _say_memory(spec, plan, say)


def _say_job(spec, plan, cost, profile, spec_path: str, say) -> None:
    model, cluster = spec.model, spec.cluster
    tokens = plan.global_batch * model.seq_len
    say(f"{spec.name}: {model.name} ({human_rate(model.param_count(), '')} params, {model.layers} layers) "
        f"on {cluster.name} ({len(cluster.datacenters)} DCs, {cluster.total_gpus} GPUs)")
    say(f"layout: pp={plan.pp} dp={plan.dp} tp={plan.tp_label()}" + (f" ep={plan.ep}" if plan.ep > 1 else "")
        + f", micro-batch {plan.micro_batch} x {plan.num_microbatches}, "
        f"schedule {plan.schedule}, {plan.precision}, checkpointing {plan.checkpointing_label()}, "
        f"sharding {plan.sharding}, optimizer {spec.job.optimizer}"
        + (", measured profile" if profile else ""))
    say(f"per iteration: {tokens:,} tokens, {human_rate(cost.training_flops(tokens), 'FLOP')} "
        f"(fwd+bwd, no recompute)")
    auto = _left_to_planner(spec.job)
    if auto:
        say(f"note: the job leaves {', '.join(auto)} to the planner; this is the default layout filled in "
            f"above, not the planner's choice -- `geotrain plan {spec_path}` picks them")


def _say_units(spec, plan, stage_cost, say) -> None:
    model, cluster, mb = spec.model, spec.cluster, plan.micro_batch
    say("\nPer unit (values for ONE unit and one micro-batch; saved = bytes kept for backward by the whole "
        "unit; times on the stage's GPU" + (", divided by the stage's tp" if max(plan.stage_tps) > 1 else "") + ")")
    rows = []
    for s, st in enumerate(plan.stages):
        gpu = cluster.gpu(cluster.dc(st.dc).gpu_type)
        sc = stage_cost[s]
        for label, kind, u, count in _unit_groups(model, st.chunks):
            f, b = sc.unit_flops(u, mb)
            t = sc.stage_times([u], gpu, mb, plan.stage_tp(s))
            rows.append([s, label, kind + (f" x{count}" if count > 1 else ""),
                         human_rate(sc.unit_params(u), ""), human_rate(f, "FLOP"), human_rate(b, "FLOP"),
                         human_bytes(sc.unit_activation_bytes(u, mb)),
                         human_seconds(t.forward), human_seconds(t.backward)])
    say(format_table(["stage", "units", "kind", "params", "fwd FLOP", "bwd FLOP", "saved/mb", "fwd", "bwd"], rows))


def _say_stage_times(spec, plan, stage_cost, say) -> None:
    cluster, mb, widest = spec.cluster, plan.micro_batch, max(plan.stage_tps)
    say("\nPer stage: time (fwd/bwd per micro-batch incl. recompute; DP sync and optimizer per iteration)")
    rows, busiest = [], (0.0, 0)
    for s, st in enumerate(plan.stages):
        dc = cluster.dc(st.dc)
        gpu = cluster.gpu(dc.gpu_type)
        units = st.units
        cost = stage_cost[s]
        tp = plan.stage_tp(s)
        t = cost.stage_times(units, gpu, mb, tp)
        tpc = cost.tp_comm_time(units, mb, tp, dc)
        sync = cost.dp_sync_time([range(a, b) for a, b in st.chunks], plan.dp, dc, plan.sharding,
                                 plan.num_microbatches, tp)
        opt = cost.optimizer_time(units, gpu, plan.sharding, plan.dp, tp)
        busy = plan.num_microbatches * (t.forward + t.backward + tpc)
        busiest = max(busiest, (busy, s))
        label = ",".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in st.chunks)
        rows.append([s, label, dc.name, dc.gpu_type, plan.stage_checkpointing(s), human_seconds(t.forward),
                     human_seconds(t.backward), human_seconds(tpc) if widest > 1 else "-",
                     human_seconds(busy), human_seconds(sync), human_seconds(opt)])
    say(format_table(["stage", "units", "DC", "GPU", "checkpointing", "fwd/mb", "bwd/mb", "TP comm/mb",
                        "compute/iter", "DP sync", "optimizer"], rows))
    say(f"busiest stage: {busiest[1]} ({human_seconds(busiest[0])} of compute per iteration)")


def _say_memory(spec, plan, say) -> None:
    cluster = spec.cluster
    peaks, note = _stage_peaks(spec, plan)
    say(f"\nPer stage: peak memory per GPU of one step (in flight = micro-batches whose activations are "
        f"held at the {plan.schedule} peak, as whole-stage equivalents; B-W = of them, those a split "
        f"backward ran B for and not yet W; transient = logits and their gradients, a recomputed block; "
        f"buffers = boundary receives/sends, gathered FSDP weights, RoPE tables; data = token ids) {note}".rstrip())
    rows, all_fit = [], True
    for s, st in enumerate(plan.stages):
        dc = cluster.dc(st.dc)
        gpu = cluster.gpu(dc.gpu_type)
        m, held, deferred = peaks[s]
        fits = m.total <= gpu.memory_bytes
        all_fit &= fits
        parts = (m.params, m.grads, m.optimizer, m.activations, m.transient, m.buffers, m.data, m.total)
        rows.append([s, plan.stage_checkpointing(s), _count(held), _count(deferred), *(human_bytes(x) for x in parts),
                     human_bytes(gpu.memory_bytes), f"{100 * m.total / gpu.memory_bytes:.0f}%",
                     "yes" if fits else "NO"])
    say(format_table(["stage", "checkpointing", "in flight", "B-W", "params", "grads", "optimizer", "activations",
                        "transient", "buffers", "data", "peak", "GPU memory", "used", "fits"], rows))
    say("all stages fit" if all_fit else "some stages do NOT fit: raise dp with zero sharding, checkpoint, "
        "or lower the micro-batch")
