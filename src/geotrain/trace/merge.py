"""One measured trace from the ranks' own files: RUN_DIR/trace/rank<R>.jsonl, written by each rank on its
host (runtime.recorder), merged where they are -- by the reporting rank after a run (the files of its
host, or all on a shared filesystem), by `geotrain report` once other hosts' files are copied in."""

from __future__ import annotations

import json
import re
from pathlib import Path

from geotrain.trace.schema import Event, Trace

RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")


def rank_files(trace_dir: Path) -> dict[int, Path]:
    """{rank: its trace file} in a run's trace directory."""
    out = {}
    for f in Path(trace_dir).glob("rank*.jsonl"):
        m = RANK_FILE.search(f.name)
        if m:
            out[int(m.group(1))] = f
    return dict(sorted(out.items()))


def merge_rank_files(trace_dir: Path, out: Path, num_ranks: int, meta: dict) -> Trace:
    """The ranks' files in `trace_dir` merged into one trace at `out`; meta["ranks_missing"] lists the
    ranks whose file is not there (another host's, not copied here yet)."""
    files = {r: f for r, f in rank_files(trace_dir).items() if r < num_ranks}   # not an older, larger run's
    missing = [r for r in range(num_ranks) if r not in files]
    trace = Trace(num_ranks=num_ranks, source="measured", meta={**meta, **({"ranks_missing": missing} if missing
                                                                             else {})})
    for f in files.values():
        with open(f) as fh:
            trace.events.extend(Event(**json.loads(line)) for line in fh if line.strip())
    trace.events.sort(key=lambda e: (e.start, e.rank))
    trace.write_jsonl(out)
    return trace


def remerge(run_dir: Path, name: str = "measured_trace.jsonl") -> Trace | None:
    """Merge again when RUN_DIR/trace holds files of ranks RUN_DIR/<name> misses (copied from other
    hosts); the header's meta is kept. None when there is nothing to add."""
    run_dir = Path(run_dir)
    path = run_dir / name
    if not path.exists():
        return None
    old = Trace.read_jsonl(path)
    missing = set(old.meta.get("ranks_missing") or [])
    if not missing or not missing & set(rank_files(run_dir / "trace")):
        return None
    meta = {k: v for k, v in old.meta.items() if k != "ranks_missing"}
    return merge_rank_files(run_dir / "trace", path, old.num_ranks, meta)
