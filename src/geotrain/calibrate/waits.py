"""What the runtime waits on besides compute and the pipeline's own transfers: the ACK of its WAN
sends before each optimizer step, and (fp16 only) the world-wide loss/overflow all-reduce.
Both feed the calibrated simulation (costs.py)."""

from __future__ import annotations


def global_sync_s(spec, plan, profile: dict, mode: str) -> float:
    """Seconds of the runtime's world-wide all-reduce of two float64 (overflow flag, loss).

    Modelled as recursive halving-doubling: log2(n) pairwise exchange steps (rank r with r xor 2^j)
    to reduce and as many to gather, each step as slow as its slowest pair. That matches what was
    measured in kernel mode on a 10 ms link: 20.8 ms at n = 2 and 21.4 ms at n = 4 (one round trip
    both times; a ring would cost 2(n-1) steps, three one-way latencies at n = 4). Each exchange
    costs its hand-off (the calibration run's measured collective over its steps; else the gloo p2p
    latency) plus, in "kernel" mode only, the WAN latency where the pair sits in
    different DCs; in "shaper" mode gloo stays on loopback and only StripedTransport is delayed.

    Only fp16 has it (runtime.trainer `StepGroup.overflow`: every rank must skip the same overflowed
    steps); bf16 and fp32 sum the loss inside the last stage's DP group and need no world-wide step,
    so they pay nothing here."""
    n = plan.num_ranks
    if n < 2 or plan.precision != "fp16":
        return 0.0
    rt = profile.get("runtime", {})
    cal = rt.get("calibration_run", {})
    hop = float(rt.get("p2p", {}).get("alpha_s", 50e-6))
    if cal.get("global_sync_s") is not None:
        # The calibration run (2 stages, stage-major ranks) crosses the WAN in one exchange step.
        measured = float(cal["global_sync_s"])
        if cal.get("wan_mode") == "kernel":
            measured -= 2 * _calibration_latency(spec, cal)
        hop = max(hop, measured / (2 * max(1, (int(cal.get("ranks", 2)) - 1).bit_length())))
    dc = [plan.dc_of_rank(r) for r in range(n)]

    def edge(a: int, b: int) -> float:
        link = spec.cluster.link(dc[a], dc[b]) if mode == "kernel" and dc[a] != dc[b] else None
        return hop + (link.latency_ms * 1e-3 if link is not None else 0.0)

    total, j = 0.0, 1
    while j < n:
        total += max(edge(r, r ^ j) for r in range(n) if (r ^ j) < n)
        j <<= 1
    return 2 * total


def _calibration_latency(spec, cal: dict) -> float:
    """One-way latency of the link the calibration run crossed (the spec's first WAN link)."""
    return float(cal.get("latency_ms", spec.cluster.wan_links[0].latency_ms if spec.cluster.wan_links else 0.0)) \
        * 1e-3


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
