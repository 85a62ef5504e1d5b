"""What the runtime waits on besides compute and the pipeline's own transfers: the ACK of its WAN
sends before each optimizer step, and the step-wide collectives before it -- fp16's world-wide
loss/overflow all-reduce, else the global gradient norm of clipping. Both feed the calibrated
simulation (calibrated_costs.py)."""

from __future__ import annotations

from geotrain.calibrate.profile_file import CalibrationRun, MeasuredProfile


def global_sync_s(spec, plan, profile: MeasuredProfile | dict, mode: str) -> float:
    """Seconds of the runtime's step-wide collectives before each optimizer step: fp16's world-wide
    all-reduce (`_world_allreduce_s`), which carries the gradient norm too, or else -- with gradient
    clipping on (`job.grad_clip` > 0) -- the global norm (`_grad_norm_s`)."""
    if plan.num_ranks < 2:
        return 0.0
    if plan.precision == "fp16":
        return _world_allreduce_s(spec, plan, profile, mode)
    return _grad_norm_s(spec, plan, profile, mode) if getattr(spec.job, "grad_clip", 0.0) > 0 else 0.0


def _hop(spec, profile: MeasuredProfile | dict) -> float:
    """One exchange's hand-off between two ranks: the calibration run's measured world-wide
    collective over its steps where it has one, else the gloo p2p latency."""
    rt = MeasuredProfile.of(profile).runtime
    cal = rt.calibration_run
    hop = rt.p2p.alpha_s if rt.p2p is not None else 50e-6
    if cal.global_sync_s is not None:
        # The calibration run (2 stages, stage-major ranks) crosses the WAN in one exchange step.
        measured = cal.global_sync_s
        if cal.wan_mode == "kernel":
            measured -= 2 * _calibration_latency(spec, cal)
        hop = max(hop, measured / (2 * max(1, (cal.ranks - 1).bit_length())))
    return hop


def _edge(spec, plan, mode: str, hop: float):
    dc = [plan.dc_of_rank(r) for r in range(plan.num_ranks)]

    def edge(a: int, b: int) -> float:
        link = spec.cluster.link(dc[a], dc[b]) if mode == "kernel" and dc[a] != dc[b] else None
        return hop + (link.latency_ms * 1e-3 if link is not None else 0.0)
    return edge


def _grad_norm_s(spec, plan, profile: MeasuredProfile | dict, mode: str) -> float:
    """The global gradient norm of a bf16/fp32 step with clipping (runtime.recipe.GradNorm): an
    all-reduce of one scalar inside each stage (its DP x TP ranks, one DC: halving-doubling, hops
    only), then every stage's total to every other stage's ranks by batch_isend_irecv -- one exchange
    whose sends complete on the receiver's acknowledgement, so a round trip of the slowest pair (the
    WAN's latency both ways in "kernel" mode). The first stage, which finishes its backward last,
    waits for it; the others already wait for that stage's total (the simulator adds this to every
    stage's step, as for fp16)."""
    hop = _hop(spec, profile)
    edge = _edge(spec, plan, mode, hop)
    inside = max(2 * (plan.dp * plan.stage_tp(s) - 1).bit_length() * hop for s in range(plan.pp))
    if plan.pp < 2:
        return inside
    firsts = [plan.rank(s, 0, 0) for s in range(plan.pp)]
    return inside + 2 * max(edge(a, b) for a in firsts for b in firsts if a != b)


def _world_allreduce_s(spec, plan, profile: MeasuredProfile | dict, mode: str) -> float:
    """Seconds of fp16's world-wide all-reduce of two float64 (overflow flag, loss).

    Modelled as recursive halving-doubling: log2(n) pairwise exchange steps (rank r with r xor 2^j)
    to reduce and as many to gather, each step as slow as its slowest pair. That matches what was
    measured in kernel mode on a 10 ms link: 20.8 ms at n = 2 and 21.4 ms at n = 4 (one round trip
    both times; a ring would cost 2(n-1) steps, three one-way latencies at n = 4). Each exchange
    costs its hand-off (the calibration run's measured collective over its steps; else the gloo p2p
    latency) plus, in "kernel" mode only, the WAN latency where the pair sits in
    different DCs; in "shaper" mode gloo stays on loopback and only StripedTransport is delayed.

    Only fp16 has it (runtime.trainer `StepGroup.overflow`: every rank must skip the same overflowed
    steps; the gradient norm rides in it)."""
    n = plan.num_ranks
    edge = _edge(spec, plan, mode, _hop(spec, profile))
    total, j = 0.0, 1
    while j < n:
        total += max(edge(r, r ^ j) for r in range(n) if (r ^ j) < n)
        j <<= 1
    return 2 * total


def _calibration_latency(spec, cal: CalibrationRun) -> float:
    """One-way latency of the link the calibration run crossed (the spec's first WAN link)."""
    if cal.latency_ms is not None:
        return cal.latency_ms * 1e-3
    return (spec.cluster.wan_links[0].latency_ms if spec.cluster.wan_links else 0.0) * 1e-3


def ack_delays(spec, cluster, mode: str) -> dict[str, float] | None:
    """When a sender holds the ACK of a WAN message, after its last byte left: "kernel" (and real
    hosts) one round trip of the (calibrated) link -- the simulator's default, None; "shaper": the
    receiver ACKs on receipt, before it holds the message for the emulated latency, so only the
    transport's own hand-offs (the calibrated per-message overhead); "off": gloo, no ACK."""
    if mode not in ("shaper", "off"):
        return None
    out = {}
    for plain, cal in zip(spec.cluster.wan_links, cluster.wan_links):
        extra = max(0.0, cal.latency_ms - plain.latency_ms) * 1e-3 if mode == "shaper" else 0.0
        a, b = plain.between
        out[f"{a}->{b}"] = out[f"{b}->{a}"] = extra
    return out
