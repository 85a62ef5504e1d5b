import pytest

from geotrain.bubbletea.bubbles import Window, bubble_windows
from geotrain.bubbletea.prefill_cost import PrefillCost
from geotrain.bubbletea.scheduler import BubbleScheduler, Request
from geotrain.bubbletea.simulated import check_no_overlap, run_bubbletea
from geotrain.bubbletea.workload import Workload
from geotrain.models.presets import PRESETS
from geotrain.models.shape import ModelShape
from geotrain.trace.schema import Event, Trace


def two_rank_trace() -> Trace:
    # rank 0 busy [0,4) and [6,10); rank 1 busy [2,8) -> period 10.
    ev = [Event(0, "forward", 0, 4), Event(0, "backward", 6, 10), Event(1, "forward", 2, 8),
          Event(1, "recv_wait", 0, 2)]
    return Trace(ev, num_ranks=2)


def test_bubble_windows_are_the_gaps_between_compute():
    windows, period = bubble_windows(two_rank_trace())
    assert period == 10
    assert windows[0] == [Window(4, 2)]
    assert windows[1] == [Window(0, 2), Window(8, 2)]


def test_chunk_cost_is_additive_over_any_split():
    c = PrefillCost(a=0.0, b=1e-3, c=1e-6)
    whole = c.chunk_time(1000)
    parts = c.chunk_time(300) + c.chunk_time(500, 300) + c.chunk_time(200, 800)
    assert parts == pytest.approx(whole)
    assert c.max_chunk(c.chunk_time(437, 100), 100) == 437


def test_request_is_chunked_across_bubbles_and_never_overruns():
    trace = two_rank_trace()
    windows, period = bubble_windows(trace)
    cost = PrefillCost(a=0.0, b=0.01, c=0.0)  # 100 tokens/s of bubble
    s = BubbleScheduler({0: windows[0]}, period, cost, margin=0.1, min_chunk=1)
    p = s.place(Request(0, arrival=0.0, prompt_len=300))
    # rank 0's only bubble is [4, 6) with 0.1 s margin: 190 tokens per period.
    assert [c.tokens for c in p.chunks] == [190, 110]
    assert p.chunks[0].start == 4 and p.chunks[0].end == pytest.approx(5.9)
    assert p.chunks[1].start == 14 and p.chunks[1].end == pytest.approx(15.1)
    assert all(c.rank == 0 for c in p.chunks)


def test_earliest_finishing_rank_is_chosen():
    windows, period = bubble_windows(two_rank_trace())
    s = BubbleScheduler(windows, period, PrefillCost(0.0, 0.01, 0.0), min_chunk=1)
    assert s.place(Request(0, arrival=0.0, prompt_len=100)).rank == 1    # rank 1 idle at t=0
    assert s.place(Request(1, arrival=0.0, prompt_len=100)).finish == pytest.approx(2.0)  # rest of rank 1's [0,2)


def test_simulated_bubbletea_fills_bubbles_without_touching_training():
    trace = two_rank_trace()
    reqs = Workload(rate_per_s=5.0, mean_prompt=50, seed=1).requests(200.0)
    res = run_bubbletea(trace, reqs, PrefillCost(0.001, 0.01, 1e-6), margin=0.05, min_chunk=8)
    check_no_overlap(trace, res)
    assert res.utilization_without == pytest.approx(0.7)
    assert res.utilization_with > 0.95
    assert res.served + res.refused == len(reqs)
    assert 0 < res.ttft_p50 <= res.ttft_p99


def test_check_no_overlap_catches_a_bad_placement():
    from geotrain.bubbletea.scheduler import Chunk, Placement
    from geotrain.bubbletea.simulated import BubbleTeaResult

    trace = two_rank_trace()
    bad = Placement(Request(0, 0, 10), 0, (Chunk(0, 0, 3.5, 4.5, 10, 0),))
    res = BubbleTeaResult(10, 10, 1, 1, 0, 0.8, 0.8, 1, 1, 1, placements=[bad])
    with pytest.raises(AssertionError):
        check_no_overlap(trace, res)


def test_prefill_cost_fit_recovers_coefficients():
    true = PrefillCost(0.002, 3e-5, 4e-9)
    samples = [((n,), true.prompt_time([n])) for n in (16, 64, 256, 512, 1024, 2048)]
    samples += [((n, n), true.prompt_time([n, n])) for n in (128, 700)]
    fit = PrefillCost.fit(samples)
    assert fit.a == pytest.approx(true.a, rel=1e-3)
    assert fit.b == pytest.approx(true.b, rel=1e-3)
    assert fit.c == pytest.approx(true.c, rel=1e-3)


def test_flops_cost_scales_with_model_size():
    from geotrain.spec.cluster import BUILTIN_GPU_TYPES

    gpu = BUILTIN_GPU_TYPES["h100-80g"]
    small = PrefillCost.from_flops(PRESETS["llama2-7b"], gpu)
    big = PrefillCost.from_flops(PRESETS["llama2-13b"], gpu)
    assert big.b > small.b and big.c > small.c
    assert isinstance(PRESETS["tiny"], ModelShape)


def test_bubbletea_on_a_simulated_plan_fills_bubbles_and_leaves_training_alone():
    from geotrain.bubbletea.simulated import bubbletea_for_plan, parse_workload
    from geotrain.planner.manual import plan_from_job
    from geotrain.sim import simulate
    from geotrain.spec import load_spec

    spec = load_spec("examples/tiny_2dc.toml")
    sim = simulate(spec, plan_from_job(spec))
    bt = bubbletea_for_plan(spec, sim, parse_workload("inference_model=tiny,iterations=20,mean_prompt=64,min_chunk=4"))
    check_no_overlap(sim.trace, bt.result)
    assert bt.result.utilization_without == pytest.approx(sim.metrics.mean_utilization, rel=1e-6)
    assert bt.result.utilization_with > 0.9
    assert bt.inference_model == "tiny" and "tiny" in bt.models_that_fit


def test_workload_parsing_errors_are_one_line_spec_errors():
    from geotrain.bubbletea.simulated import parse_workload
    from geotrain.errors import SpecError

    assert parse_workload("load=0.5,seed=3").load == 0.5
    for bad in ("load", "bogus=1", "load=fast", "inference_model=nope"):
        with pytest.raises(SpecError):
            parse_workload(bad)
