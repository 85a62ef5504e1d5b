"""What the runtime waits on besides compute and the pipeline's own transfers: the ACK of its WAN
sends before each optimizer step, fp16's world-wide loss/overflow all-reduce before it, and -- with
clipping in bf16/fp32 -- the gradient norm's exchange, priced as its messages (`norm_exchange`).
All feed the calibrated simulation (calibrated_costs.py)."""

from __future__ import annotations

from geotrain.calibrate.profile_file import CalibrationRun, MeasuredProfile
from geotrain.layout.stage_costs import NormExchange


def global_sync_s(spec, plan, profile: MeasuredProfile | dict, mode: str) -> float:
    """Seconds of the runtime's step-wide collective before each optimizer step: fp16's world-wide
    all-reduce (`_world_allreduce_s`), which carries the gradient norm too. bf16/fp32 has none:
    clipping's norm goes stage to stage (`norm_exchange`), not through a world-wide collective."""
    if plan.num_ranks < 2 or plan.precision != "fp16":
        return 0.0
    return _world_allreduce_s(spec, plan, profile, mode)


def norm_exchange(spec, plan, profile: MeasuredProfile | dict, mode: str) -> NormExchange | None:
    """The gradient norm's exchange of a bf16/fp32 step with clipping (runtime.recipe.GradNorm), for
    the simulator to run as messages, as the analytic `StageCosts.norm_exchange` is: per stage a
    one-scalar all-reduce over its dp x tp ranks (halving-doubling, hops only inside its DC), then
    one float64 per boundary down the pipeline (the partial sums) and back up (the total), each
    delivered after that boundary's edge: the hand-off, plus the WAN latency in "kernel" mode (gloo
    crosses the emulated WAN; in "shaper" mode it stays on loopback). The receives are posted
    before the iteration, so each message costs one way, never a round trip. None: no exchange."""
    if getattr(spec.job, "grad_clip", 0.0) <= 0 or plan.precision == "fp16":
        return None
    edge = _edge(spec, plan, mode, _hop(spec, profile))
    reduce = []
    for s in range(plan.pp):
        ranks = plan.stage_ranks(s)
        steps = (len(ranks) - 1).bit_length()
        reduce.append(2 * steps * max(edge(a, b) for a in ranks for b in ranks if a != b) if steps else 0.0)
    return NormExchange(reduce, [edge(plan.rank(s, 0, 0), plan.rank(s + 1, 0, 0)) for s in range(plan.pp - 1)])


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
