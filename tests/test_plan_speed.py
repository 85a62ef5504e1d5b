"""Planning speed, in CPU time (the machines running the suite are shared: wall time under load
says little). Targets (bench/bench_planner.py): five zones in a full mesh <= 1 s, the 8,192-GPU
example < 2 s, both including the simulated finalists; the bounds here are twice that, loose
enough for a loaded machine, tight enough to catch the search losing its pruning (the 8k
example took 2.7 s CPU before the split bound and the cutoff, 7.6 s wall the round before)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from geotrain.planner.confirm import make_plan
from geotrain.spec import load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("example, bound_s", [("opt350m_a100_5zone", 2.0), ("llama2_70b_4dc_8k", 4.0)])
def test_planning_cpu_time(example, bound_s):
    spec = load_spec(EXAMPLES / f"{example}.toml")
    make_plan(load_spec(EXAMPLES / "tiny_2dc.toml"))   # imports and first-use caches out of the timing
    t0 = time.process_time()
    res = make_plan(spec, top_k=3)
    cpu = time.process_time() - t0
    assert len(res.finalists) >= 3          # the finalists really were simulated
    assert cpu <= bound_s, f"{example}: {cpu:.2f} s CPU (bound {bound_s} s)"
