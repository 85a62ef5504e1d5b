"""Chrome / Perfetto export: valid JSON, one X event per trace event, microseconds, tracks."""

from __future__ import annotations

import json

from test_report_common import gpipe_trace, two_dc_plan

from geotrain.trace.chrome import to_chrome, write_chrome
from geotrain.trace.schema import Event, Trace


def test_chrome_export_round_trip(tmp_path):
    plan = two_dc_plan(pp=2, dp=2, m=3)
    trace = gpipe_trace(plan, tf=0.001, tb=0.002, comm=0.0005)
    path = tmp_path / "t.json"
    n = write_chrome(trace, path)
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert n == len(xs) == len(trace.events)

    # Timestamps in microseconds: every source event appears with ts = start * 1e6.
    src = sorted((e.kind, round(e.start * 1e6, 3), round(e.duration * 1e6, 3)) for e in trace.events)
    got = sorted((e["cat"], round(e["ts"], 3), round(e["dur"], 3)) for e in xs)
    assert src == got

    # One process per DC (+ the links process); one named thread per rank.
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == ["DC east", "DC west", "WAN / links"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    for r in range(plan.num_ranks):
        s, rep, _ = plan.coords(r)
        dc_pid = [p for p, name in procs.items() if name == f"DC {plan.stages[s].dc}"][0]
        assert threads[(dc_pid, r)] == f"rank {r} stage {s} dp {rep}"
        rank_events = [e for e in xs if e["tid"] == r and e["pid"] == dc_pid]
        assert len(rank_events) == sum(1 for e in trace.events if e.rank == r and e.kind != "transfer")

    # Transfers sit on link tracks and carry their args.
    xfers = [e for e in xs if e["cat"] == "transfer"]
    assert xfers and all(procs[e["pid"]] == "WAN / links" for e in xfers)
    assert all({"stage", "mb", "bytes", "link"} <= set(e["args"]) for e in xfers)
    assert {threads[(e["pid"], e["tid"])].split(" #")[0] for e in xfers} == {e.link for e in trace.events
                                                                              if e.kind == "transfer"}


def test_overlapping_transfers_get_separate_lanes():
    """Chrome needs the slices of a thread to nest; two half-overlapping transfers must not share one."""
    ev = [Event(0, "forward", 0.0, 1.0, stage=0, mb=0),
          Event(0, "transfer", 1.0, 3.0, stage=0, mb=0, bytes=10, link="a->b", peer=1),
          Event(0, "transfer", 2.0, 4.0, stage=0, mb=1, bytes=10, link="a->b", peer=1),
          Event(0, "transfer", 3.5, 5.0, stage=0, mb=2, bytes=10, link="a->b", peer=1)]
    doc = to_chrome(Trace(events=ev, num_ranks=2))
    xf = sorted((e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "transfer"), key=lambda e: e["ts"])
    assert xf[0]["tid"] != xf[1]["tid"]
    assert xf[2]["tid"] == xf[0]["tid"]        # the first lane is free again at 3.5
    # Without a plan the DC is unknown but every rank still gets a track.
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert "rank 0 stage 0" in names and "rank 1" in names
