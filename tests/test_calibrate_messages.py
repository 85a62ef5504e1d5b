"""What the calibration reads off a measured trace (per-message WAN overhead, the global all-reduce),
the shaper's exact pacing those numbers rely on, and `train --profile`'s calibrated prediction."""

from __future__ import annotations

import time
from dataclasses import asdict
from types import SimpleNamespace

import pytest

from geotrain.calibrate.messages import global_sync, message_overheads, waiting_overhead
from geotrain.emulation import user_shaper as shaper_module
from geotrain.emulation.user_shaper import Shaper, ShaperConfig
from geotrain.trace.schema import Event, Trace


def _pp2_trace(latency: float, ser: float, extra_waiting: float, extra_busy: float) -> Trace:
    """Two iterations of a pp=2 pipeline: mb 0's activation arrives while rank 1 waits (`extra_waiting`
    late); mb 1's while rank 1 still computes (picked up late by `extra_busy`, hidden by compute)."""
    ev = []
    for it in (1, 2):
        t = 10.0 * it
        ev.append(Event(rank=0, kind="forward", start=t, end=t + 0.002, stage=0, mb=0, iteration=it))
        due = t + 0.002 + latency + ser
        ev.append(Event(rank=1, kind="recv_wait", start=t, end=due + extra_waiting, stage=1, mb=0, iteration=it,
                        bytes=32768))
        ev.append(Event(rank=0, kind="forward", start=t + 0.002, end=t + 0.004, stage=0, mb=1, iteration=it))
        busy_until = t + 0.004 + latency + ser + extra_busy
        ev.append(Event(rank=1, kind="forward", start=due, end=busy_until, stage=1, mb=0, iteration=it))
        ev.append(Event(rank=1, kind="recv_wait", start=busy_until, end=busy_until, stage=1, mb=1, iteration=it,
                        bytes=32768))
        ev.append(Event(rank=0, kind="recv_wait", start=t + 1, end=t + 1 + 0.001 * it, stage=-1, iteration=it))
        ev.append(Event(rank=1, kind="recv_wait", start=t + 1, end=t + 1.003, stage=-1, iteration=it))
    return Trace(events=ev, num_ranks=2)


def test_only_messages_a_waiting_receiver_saw_arrive_set_the_overhead():
    lat, per_byte = 0.010, 1 / 6.25e6
    trace = _pp2_trace(lat, 32768 * per_byte, extra_waiting=0.0008, extra_busy=0.020)
    plan = SimpleNamespace(pp=2, dp=1, rank=lambda s, d: s * 1 + d)
    rows = message_overheads(trace, plan, lat, per_byte, warmup=0)
    assert sorted(w for _, w in rows) == [False, False, True, True]
    assert waiting_overhead(trace, plan, lat, per_byte, warmup=0) == pytest.approx(0.0008, abs=1e-9)
    # Counted against a 2 ms link the same arrivals look 8 ms late: the latency is taken out.
    assert waiting_overhead(trace, plan, 0.002, per_byte, warmup=0) == pytest.approx(0.0088, abs=1e-9)


def test_global_sync_is_the_shortest_wait_per_iteration():
    trace = _pp2_trace(0.01, 0.005, 0.001, 0.0)
    assert global_sync(trace, warmup=0) == pytest.approx(0.0015)       # median of 1 ms and 2 ms
    assert global_sync(trace, warmup=1) == pytest.approx(0.002)


class _Clock:
    """Stands in for the shaper's `time`: only sleeps move it, each by what was asked plus `late_s`
    (a loaded CPU's late wake-up). The pacing arithmetic is then checked exactly, whatever the load;
    the real clock only bounds it from the side load cannot push it (the shaper really waits)."""

    def __init__(self, late_s: float = 0.0):
        self.now, self.late_s = 1000.0, late_s

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s + self.late_s


def _lone_block_s(exact: bool, clock=time, nbytes: int = 32768, gbps: float = 0.01) -> float:
    conn = Shaper(ShaperConfig(per_connection_gbps=gbps, aggregate_gbps=1.0, exact=exact)).connection()
    t0 = clock.monotonic()
    conn.wait_for(nbytes)
    return clock.monotonic() - t0


def test_exact_pacing_charges_a_lone_message_its_serialization_time(monkeypatch):
    ser = 32768 * 8 / 0.01e9                    # 26 ms at 10 Mbit/s
    assert _lone_block_s(exact=True) >= ser - 1e-3          # real clock: held at least that long
    clock = _Clock()
    monkeypatch.setattr(shaper_module, "time", clock)
    assert _lone_block_s(exact=True, clock=clock) == pytest.approx(ser, rel=1e-9)
    assert _lone_block_s(exact=False, clock=clock) == 0.0   # burst credit: leaves at once


def _bulk_s(clock=time, blocks: int = 8, nbytes: int = 16 << 10) -> float:
    """Seconds for one transfer of `blocks` blocks paced back-to-back on one connection (as the
    transport paces a transfer), the aggregate cap binding."""
    conn = Shaper(ShaperConfig(per_connection_gbps=0.08, aggregate_gbps=0.04)).connection()
    t0 = clock.monotonic()
    for i in range(blocks):
        conn.wait_for(nbytes, follows=i > 0)
    return clock.monotonic() - t0


def test_exact_pacing_keeps_the_bulk_rate_and_the_binding_cap(monkeypatch):
    ser = 8 * (16 << 10) * 8 / 0.04e9           # 26 ms at the binding 40 Mbit/s
    assert _bulk_s() >= ser - 1e-3              # real clock: never faster than the binding cap
    monkeypatch.setattr(shaper_module, "time", _Clock())
    assert _bulk_s(shaper_module.time) == pytest.approx(ser, rel=1e-9)
    # Every wake-up 1 ms late: the blocks still leave back-to-back, the transfer ends 1 ms late
    # (its last wake-up), not 8 ms (booked from each wake-up, 3.3 ms blocks lost 23% of the rate).
    monkeypatch.setattr(shaper_module, "time", _Clock(late_s=0.001))
    assert _bulk_s(shaper_module.time) == pytest.approx(ser + 0.001, rel=1e-9)


def test_train_profile_writes_a_calibrated_prediction(tmp_path):
    from geotrain.calibrate.cases import Case, case_plan, write_spec
    from geotrain.calibrate.predict import write_prediction
    from geotrain.calibrate.profile_file import save_profile
    from geotrain.calibrate.timers import time_unit
    from geotrain.sim import simulate

    case = Case("train-profile", latency_ms=10, per_connection_mbps=50)
    spec = write_spec(case, tmp_path / "spec")
    plan = case_plan(spec, case)
    m = spec.model
    prof = {kind: {"2": list(time_unit(m, index, 2, "bf16", repeats=2))}
            for kind, index in (("embedding", 0), ("block", 1), ("head", m.layers + 1))}
    prof["runtime"] = {"cores": 2, "per_action_s": 2e-5, "wan_message_overhead_s": 1e-3,
                       "calibration_run": {"background_runnable": 0.0, "wan_mode": "shaper", "global_sync_s": 2e-3}}
    save_profile(prof, tmp_path / "profile.json")
    assert write_prediction(spec, plan, tmp_path, str(tmp_path / "profile.json"), "shaper", iterations=2)
    pred = Trace.read_jsonl(tmp_path / "predicted_trace.jsonl")
    assert pred.meta["calibrated"]["wan_mode"] == "shaper"
    # The measured block time, not the peak-FLOP estimate, sets the forward of a stage.
    fwd = min(e.duration for e in pred.events if e.kind == "forward" and e.rank == 1)
    plain = simulate(spec, plan, iterations=2).trace
    plain_fwd = min(e.duration for e in plain.events if e.kind == "forward" and e.rank == 1)
    assert fwd >= prof["block"]["2"][0]
    assert fwd != pytest.approx(plain_fwd, rel=0.2)


@pytest.mark.slow
def test_profile_pool_probes_the_per_message_overhead_over_latency():
    """The profile's WAN probe (two real processes over StripedTransport with the shaper): a lone
    boundary tensor's cost beyond latency + size / rate at each probed latency, and the gap of
    back-to-back messages. Each must be a real, small positive time -- were the probe's delay not
    applied the overhead would clamp to 0; were the latency not taken off, it would reach 20-40 ms."""
    from geotrain.calibrate.pool import PROBE_LATENCIES_MS, run_pool
    from geotrain.models.presets import PRESETS

    m = PRESETS["tiny"]
    boundary = 4 * 2 * m.seq_len * m.hidden
    task = {"model": asdict(m), "micro_batch": 2, "precision": "bf16", "contention_s": 0.05,
            "dp_sizes": [2], "allreduce_bytes": [4096], "p2p_bytes": [4096], "boundary_bytes": boundary,
            "wan": {"per_connection_gbps": 0.1, "aggregate_gbps": 1.0, "latency_ms": 5.0, "connections": [1],
                    "seconds": 0.05}}
    pool, _ = run_pool(2, task)
    probe = pool[1]["wan_messages"]
    assert probe["bytes"] == boundary
    assert sorted(float(k) for k in probe["overhead_s"]) == sorted(PROBE_LATENCIES_MS)
    for lat, over in probe["overhead_s"].items():      # 0.7-1.5 ms measured here; loose for a busy machine
        assert 0 < over < 15e-3, (lat, over)
    assert 0 <= probe["gap_s"] < 0.02
