"""simulate(spec, plan): costs from the cost model, on the built-in example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geotrain.costs import CostModel
from geotrain.layout.wan_bytes import NORM_BYTES
from geotrain.planner.manual import plan_from_job
from geotrain.sim import simulate
from geotrain.spec import load_spec
from geotrain.trace.schema import Trace


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "tiny_2dc.toml")
    return spec, plan_from_job(spec)


def test_tiny_example_runs(tiny, tmp_path):
    spec, plan = tiny
    res = simulate(spec, plan, iterations=2)
    m = res.metrics
    assert res.trace.num_ranks == plan.num_ranks == 4
    assert m.iterations == 2 and m.iteration_time > 0
    assert m.tokens_per_s == pytest.approx(plan.global_batch * spec.model.seq_len / m.iteration_time)
    assert set(m.link_utilization) == {"east->west", "west->east"}
    assert m.wan_bytes == 2 * plan.dp * plan.num_microbatches * plan.micro_batch * spec.model.seq_len * \
        spec.model.hidden * 2 + 2 * plan.dp * NORM_BYTES   # bf16 activations and gradients, both directions;
    # and the gradient norm's float64 per replica each way (clipping is on by default)
    assert set(m.peak_memory) == set(range(4)) and all(v > 0 for v in m.peak_memory.values())
    # The trace file round-trips and gives the same metrics.
    path = tmp_path / "trace.jsonl"
    res.trace.write_jsonl(path)
    back = Trace.read_jsonl(path)
    assert len(back.events) == len(res.trace.events)
    assert json.loads(path.read_text().splitlines()[0])["header"]["meta"]["links"]["east->west"]["kind"] == "wan"
    from geotrain.trace.metrics import compute_metrics

    again = compute_metrics(back, plan.global_batch * spec.model.seq_len)
    assert again.iteration_time == pytest.approx(m.iteration_time)
    assert len(again.bubbles) == len(m.bubbles)
    for (r1, s1, e1), (r2, s2, e2) in zip(again.bubbles, m.bubbles):
        assert r1 == r2 and s1 == pytest.approx(s2) and e1 == pytest.approx(e2)


def test_durations_come_from_the_cost_model(tiny):
    spec, plan = tiny
    res = simulate(spec, plan)
    cost = CostModel(spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=spec.job.optimizer)
    for s, st in enumerate(plan.stages):
        dc = spec.cluster.dc(st.dc)
        t = cost.stage_times(st.units, spec.cluster.gpu(dc.gpu_type), plan.micro_batch, plan.tp)
        r = plan.rank(s, 0)
        fwd = [e.duration for e in res.trace.events if e.rank == r and e.kind == "forward"]
        bwd = [e.duration for e in res.trace.events if e.rank == r and e.kind == "backward"]
        assert len(fwd) == len(bwd) == plan.num_microbatches
        assert fwd == pytest.approx([t.forward] * len(fwd)) and bwd == pytest.approx([t.backward] * len(bwd))
        ar = [e for e in res.trace.events if e.rank == r and e.kind == "allreduce"]
        assert ar[0].duration == pytest.approx(cost.dp_sync_time([st.units], plan.dp, dc, plan.sharding,
                                                                 plan.num_microbatches))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1", "wan-1f1b"])
def test_every_schedule_kind_simulates(tiny, kind):
    spec, plan = tiny
    res = simulate(spec, plan.with_(schedule=kind))
    assert res.schedule.kind == kind and res.metrics.iteration_time > 0


def test_progress_bar_does_not_change_results(tiny):
    spec, plan = tiny
    a = simulate(spec, plan).metrics
    b = simulate(spec, plan, progress=True).metrics
    assert a.iteration_time == b.iteration_time
