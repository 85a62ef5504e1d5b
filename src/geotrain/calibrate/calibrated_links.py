"""The WAN links and intra-DC transfers of a calibrated simulation: the spec's cluster with what a
profile measured in place of its numbers (calibrate.calibrated_costs uses it).

Intra-DC point-to-point: the cluster's intra-DC latency and bandwidth replaced by the measured gloo
isend/irecv fit. WAN messages: the user-space WAN hands each message through several threads
(dispatcher, writers, reader, delay timer, the waiting rank), each of which waits for a core on a
busy machine; the profile's calibration run measures this per-message overhead off its trace
(`wan_message_overhead_s`, messages.py) at the spec's latency, the profile's isolated probe how it
changes with latency (`wan_messages`, message_overhead_s); added to the link latency and scaled with
the CPU sharing of each run. A message queued behind another on the same connections pays the
dispatcher/writer hand-off again as link time (the probe's back-to-back `gap_s`): the link's rate
for boundary tensors is lowered by that much.
"""

from __future__ import annotations

import numpy as np

from geotrain.calibrate.profile_file import MeasuredProfile, WanMessages


def slowdown(concurrent: float, background: float, cores: int) -> float:
    """Processor sharing: `concurrent` of our ranks computing at once beside `background` runnable
    threads of other work on `cores` cores each get cores / (concurrent + background) of a core,
    at most one."""
    return max(1.0, (concurrent + background) / max(1, cores))


def calibrated_cluster(spec, profile: MeasuredProfile | dict, background: float | None = None, mode: str = "shaper",
                       boundary_bytes: int = 0, message_scale: float | None = None, plan=None):
    """The spec's cluster with intra-DC latency/bandwidth replaced by the measured gloo p2p, and each
    WAN message's transport overhead (thread hand-offs in the user-space WAN, which wait for a core
    when the machine is busy) added to the WAN latency, scaled by the CPU sharing at `background`
    (processor sharing), or by `message_scale` when the run's CPU sharing was measured (predict)."""
    profile = MeasuredProfile.of(profile)
    rt = profile.runtime
    cluster = spec.cluster
    p2p = rt.p2p
    if p2p:
        dcs = []
        for dc in cluster.datacenters:
            upd = {"intra_dc_latency_us": p2p.alpha_s * 1e6}
            if p2p.per_byte_s > 0:
                upd["intra_dc_gbps"] = 8 / p2p.per_byte_s / 1e9
            dcs.append(dc.model_copy(update=upd))
        cluster = cluster.model_copy(update={"datacenters": dcs})
    if mode == "off" and cluster.wan_links:
        # `--wan off`: no emulated WAN, every pair on gloo over loopback like a pair inside a DC.
        dc0 = cluster.datacenters[0]
        links = [wl.model_copy(update={"latency_ms": dc0.intra_dc_latency_us * 1e-3, "capacity_gbps": dc0.intra_dc_gbps,
                                       "per_connection_gbps": dc0.intra_dc_gbps}) for wl in cluster.wan_links]
        return cluster.model_copy(update={"wan_links": links})
    if cluster.wan_links and (rt.wan_message_overhead_s or rt.wan_messages):
        ncores = rt.cores or 1
        b0 = rt.calibration_run.background_runnable or 0.0
        b = b0 if background is None else background
        scale = slowdown(1, b, ncores) / slowdown(1, b0, ncores) if message_scale is None else message_scale
        links = []
        for wl in cluster.wan_links:
            extra, gap = message_overhead_s(profile, wl.latency_ms)
            if mode != "shaper":
                # The kernel queues the next message's bytes while the transport hands it on: a
                # queued message pays no gap (measured: back-to-back arrivals size / rate apart).
                extra, gap = extra + gap, 0.0
            upd = {"latency_ms": wl.latency_ms + 1e3 * extra * scale}
            if gap > 0 and boundary_bytes:
                # Each message holds its connections for its stripe's size / rate + gap (a queued
                # message pays the hand-off again, whatever the number of stripes): the link's rate
                # for boundary-sized messages.
                lp = plan.link_between(*wl.between) if plan is not None else None
                stripe = boundary_bytes / (max(1, lp.connections) if lp is not None else 1)
                per_conn = stripe / (stripe / (wl.per_connection_gbps * 1e9 / 8) + gap * scale)
                upd["per_connection_gbps"] = per_conn * 8 / 1e9
                upd["capacity_gbps"] = wl.capacity_gbps * per_conn * 8 / 1e9 / wl.per_connection_gbps
            links.append(wl.model_copy(update=upd))
        cluster = cluster.model_copy(update={"wan_links": links})
    return cluster


def message_overhead_s(profile: MeasuredProfile | dict, latency_ms: float) -> tuple[float, float]:
    """(per-message overhead, per-queued-message gap) in seconds on a WAN link of `latency_ms`.

    The level comes from the calibration run (`wan_message_overhead_s`, read off its trace at the
    spec's link latency L0, messages.py); how it changes with latency from the profile's isolated
    probe (`wan_messages.overhead_s` at PROBE_LATENCIES_MS, profile._wan_messages): the run's value
    times probe(L) / probe(L0), probe interpolated linearly in latency and flat past the ends. The
    hand-offs of a message wake threads that slept about one latency (reader, delay timer, the
    waiting rank); measured, the cost rises from 2 to 40 ms links and levels off (the validation
    traces: median 1.4 / 2.3 / 3.3 ms at 2 / 10 / 40 ms over five runs; an isolated probe
    0.7 / 0.9 / 1.3 ms on a loaded machine, 2.9 / 3.5 / 4.4 ms on a quiet one).

    The gap is charged as link time (calibrated_cluster lowers the link's rate for boundary-sized
    messages), so it is taken off the per-message overhead here: a message nobody queues behind
    costs the measured overhead in total, each one queued behind another pays the gap again. The
    probe's gap is scaled like its overhead (run / probe at L0): in the run the sender computes while
    its dispatcher and writer hand the next message on."""
    rt = MeasuredProfile.of(profile).runtime
    level = rt.wan_message_overhead_s
    probe = rt.wan_messages or WanMessages()
    curve = sorted((float(k), float(v)) for k, v in probe.overhead_s.items())
    gap = probe.gap_s
    if curve and all(v > 0 for _, v in curve):
        l0 = rt.calibration_run.latency_ms if rt.calibration_run.latency_ms is not None else latency_ms
        ref = _interp(curve, l0)
        # The run's hand-offs cost `in_run` times the probe's (the peer computes, the cores are
        # shared); the queued message's gap is made of the same hand-offs.
        in_run = level / ref if level > 0 else 1.0
        level, gap = in_run * _interp(curve, latency_ms), in_run * gap
    gap = min(gap, level)
    return max(0.0, level - gap), gap


def _interp(points: list[tuple[float, float]], x: float) -> float:
    xs, ys = zip(*points)
    return float(np.interp(x, xs, ys))
