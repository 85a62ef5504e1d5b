"""Launch 4 ranks of `_count_collectives.py` on a list of RunCases and read back what each
counted -- the one launcher the collective-count tests (bytes, world sync) share. Their cases run
in ONE launch per session (`counted_cases`, conftest's `collective_counts`): four rank processes
started once instead of twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from geotrain.runtime.launch import free_port
from geotrain.runtime.runfile import write_run_config

ROOT = Path(__file__).resolve().parents[1]


def run_counted(tmp: Path, cases: list, timeout: float, world: int = 4) -> list[dict]:
    cfg = tmp / "cases.json"
    write_run_config(cfg, cases)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                                                  os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_count_collectives.py"), str(cfg),
                               str(tmp / f"counts{r}.json")], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=open(tmp / f"rank{r}.log", "w"))
             for r in range(world)]
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0, (tmp / "rank0.log").read_text()[-3000:]
    finally:
        for p in procs:
            p.kill()
    return [json.loads((tmp / f"counts{r}.json").read_text()) for r in range(world)]


def counted_cases(tmp: Path, groups: dict[str, list], timeout: float) -> dict[str, list[list[dict]]]:
    """Run every group's cases in one launch; per group, per rank, what its cases counted."""
    names = [n for n, cases in groups.items() for _ in cases]
    counts = run_counted(tmp, [c for cases in groups.values() for c in cases], timeout)
    return {g: [[x for n, x in zip(names, per_rank) if n == g] for per_rank in counts] for g in groups}
