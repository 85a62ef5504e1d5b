"""runtime.recorder: the trace off the hot path -- events stream to the rank's file (bounded memory), CUDA
events are recorded without synchronising and resolved once completed, and per-host files are merged
where they are (trace.merge; `geotrain report` after copying another host's files in)."""

from __future__ import annotations

import json
import time

import torch

from geotrain.runtime import recorder as R
from geotrain.trace.merge import merge_rank_files, remerge
from geotrain.trace.schema import Trace


def test_events_stream_to_the_file_and_memory_stays_bounded(tmp_path):
    rec = R.Recorder(3, time.time(), path=tmp_path / "trace" / "rank3.jsonl", flush_lines=64)
    for i in range(5000):
        rec.iteration = i // 100
        t = rec.now()
        rec.add("forward", t, t + 0.001, stage=0, mb=i % 4)
        assert len(rec._lines) < 64 and not rec._pending          # nothing piles up in memory
    rec.close()
    lines = (tmp_path / "trace" / "rank3.jsonl").read_text().splitlines()
    assert len(lines) == 5000 and json.loads(lines[-1])["rank"] == 3
    assert abs(rec.totals()["forward"] - 5.0) < 1e-6 and abs(rec.totals(first_iteration=49)["forward"] - 0.1) < 1e-6


class _FakeEvent:
    """torch.cuda.Event on a fake GPU clock: completes when the test says, counts synchronisations."""

    clock, syncs, done_upto = 0.0, 0, 0
    made: list = []

    def __init__(self, enable_timing=False):
        self.t, self.i = None, len(_FakeEvent.made)
        _FakeEvent.made.append(self)

    def record(self, stream=None):
        _FakeEvent.clock += 0.5
        self.t = _FakeEvent.clock

    def query(self):
        return self.i < _FakeEvent.done_upto

    def synchronize(self):
        _FakeEvent.syncs += 1
        _FakeEvent.done_upto = max(_FakeEvent.done_upto, self.i + 1)

    def elapsed_time(self, other):
        assert self.query() and other.query()
        return (other.t - self.t) * 1e3


def test_cuda_events_are_recorded_without_synchronising_and_resolved_once_done(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.made, _FakeEvent.syncs, _FakeEvent.done_upto, _FakeEvent.clock = [], 0, 0, 0.0
    rec = R.Recorder(0, 0.0, path=tmp_path / "rank0.jsonl", device=torch.device("cuda", 0))
    for mb in range(4):
        a = rec.mark()
        rec.add("forward", a, rec.mark(), mb=mb)
    assert _FakeEvent.syncs == 1                 # the anchor, once: no synchronisation per event
    rec.flush()
    assert len(rec._pending) == 4                # nothing completed on the "GPU" yet: nothing waited for
    _FakeEvent.done_upto = 5                     # the anchor and the first two forwards' events
    rec.flush()
    assert len(rec._pending) == 2 and _FakeEvent.syncs == 1
    rec.close()                                  # the end of the run waits for the rest
    events = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [e["mb"] for e in events] == [0, 1, 2, 3]
    assert all(abs(e["end"] - e["start"] - 0.5) < 1e-9 for e in events)   # the GPU's durations, not the host's
    assert events[0]["start"] < events[1]["start"]


def test_per_host_trace_files_are_merged_where_they_are(tmp_path):
    for r in (0, 1, 2, 3):      # ranks 0-1 on host A (here), 2-3 on host B
        d = tmp_path / ("run" if r < 2 else "hostB") / "trace"
        rec = R.Recorder(r, 0.0, path=d / f"rank{r}.jsonl")
        rec.add("forward", 0.1 * r, 0.1 * r + 0.05)
        rec.close()
    run = tmp_path / "run"
    merged = merge_rank_files(run / "trace", run / "measured_trace.jsonl", 4, {"plan": "p"})
    assert {e.rank for e in merged.events} == {0, 1} and merged.meta["ranks_missing"] == [2, 3]
    assert remerge(run) is None                  # nothing new to add yet
    for r in (2, 3):                             # the user copies host B's files in
        (run / "trace" / f"rank{r}.jsonl").write_text((tmp_path / "hostB" / "trace" / f"rank{r}.jsonl").read_text())
    again = remerge(run)
    assert again is not None and {e.rank for e in again.events} == {0, 1, 2, 3}
    assert "ranks_missing" not in Trace.read_jsonl(run / "measured_trace.jsonl").meta
    assert Trace.read_jsonl(run / "measured_trace.jsonl").meta["plan"] == "p"
