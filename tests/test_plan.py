"""Planner: placement rules, balanced split, WAN connections, temporal sharing, baselines, errors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from geotrain.errors import InfeasibleError
from geotrain.planner.chains import Layout
from geotrain.planner.confirm import make_plan
from geotrain.planner.context import PlanningContext
from geotrain.planner.scorer import Scorer
from geotrain.planner.split import balanced_split, prefix_sums
from geotrain.spec import load_spec


@pytest.fixture(scope="module")
def a100(examples_dir_module):
    """The Llama-2-7B 3-DC A100 example at 4096 sequences a step: a pipeline across two DCs (at the
    example's 1024, and at 2048, one DC is as fast: the pipeline's WAN activations cost more than
    its extra GPUs save, compute being priced by costs.roofline's fit)."""
    spec = load_spec(examples_dir_module / "llama2_7b_a100_3dc.toml")
    spec = replace(spec, job=spec.job.model_copy(update={"global_batch": 4096}))
    return spec, make_plan(spec, top_k=2)


@pytest.fixture(scope="module")
def examples_dir_module():
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "examples"


def check_rules(spec, plan):
    cl = spec.cluster
    names = {d.name for d in cl.datacenters}
    # Each stage (with all its dp replicas) in one existing DC: DP never crosses the WAN.
    assert all(st.dc in names for st in plan.stages)
    for dc, used in plan.gpus_per_dc().items():
        assert used <= cl.dc(dc).gpus
    # A DC hosts consecutive stages only, and consecutive DCs are linked.
    chain = []
    for st in plan.stages:
        if not chain or chain[-1] != st.dc:
            assert st.dc not in chain, "a DC must host consecutive stages"
            chain.append(st.dc)
    for a, b in zip(chain, chain[1:]):
        assert cl.link(a, b) is not None
        assert plan.link_between(a, b) is not None
    # Units cover the model exactly once, in order.
    units = [u for a, b in plan.virtual_units() for u in range(a, b)]
    assert units == list(range(spec.model.num_units))
    assert plan.dp * plan.micro_batch * plan.num_microbatches == spec.job.global_batch


def test_placement_rules_hold(a100):
    spec, res = a100
    check_rules(spec, res.plan)
    assert res.sim is not None and res.iteration_s > 0
    assert res.lower_bound_s <= res.iteration_s * 1.0001
    assert res.bottleneck in ("compute", "wan-bandwidth", "wan-latency", "memory")
    assert any("Lower bound" in line for line in res.explanation)


def test_connections_are_fewest_reaching_capacity(a100):
    spec, res = a100
    for lp in res.plan.links:
        link = spec.cluster.link(lp.src_dc, lp.dst_dc)
        n = lp.connections
        if lp.sharing == "temporal":
            assert link.rate_gbps(n) == link.capacity_gbps
            assert n == 1 or link.rate_gbps(n - 1) < link.capacity_gbps
        else:  # dp concurrent transfers share the link: together they reach it
            assert res.plan.dp * n * link.per_connection_gbps >= link.capacity_gbps


def test_temporal_sharing_order_and_offsets(a100):
    spec, res = a100
    plan = res.plan
    assert plan.dp > 1 and plan.links, "this example should use the WAN with dp > 1"
    temporal = [lp for lp in plan.links if lp.sharing == "temporal"]
    if not temporal:  # the fair variant simulated faster: then it must have been offered
        assert any(name.endswith("-fair") for name, _, _ in res.finalists)
        return
    for lp in temporal:
        assert lp.order == tuple(range(plan.dp))
        assert lp.stagger_s > 0
    # Lockstep start unless the simulator preferred the staggered-start variant it was offered.
    names = [name for name, _, _ in res.finalists]
    assert any(n.endswith("-offsets") for n in names) and any(n.endswith("-fair") for n in names)
    if plan.pipeline_offsets:
        assert plan.pipeline_offsets[0] == 0.0 and plan.pipeline_offsets[1] == pytest.approx(temporal[0].stagger_s)


def test_baselines_are_all_evaluated(a100):
    """(Whether the plan beats them held by construction -- they are among its finalists -- so the
    planner's quality is checked against the exhaustive optimum in test_plan_exhaustive.py.)"""
    from geotrain.planner.baselines import evaluate_baselines

    spec, _ = a100
    base = evaluate_baselines(spec)
    assert {b.name for b in base} == {"dp-across-dcs", "naive-pp", "varuna", "single-dc"}
    assert all(b.plan is not None for b in base if b.name != "dp-across-dcs")


def test_balanced_split_is_optimal_on_synthetic_costs():
    fast = prefix_sums([1.0] * 12)
    slow = prefix_sums([3.0] * 12)
    ranges = balanced_split([slow, fast])
    assert ranges == [(0, 3), (3, 12)]  # 9 s each
    ranges = balanced_split([fast, fast, fast])
    assert ranges == [(0, 4), (4, 8), (8, 12)]


def test_split_gives_the_faster_dc_more_layers(examples_dir_module):
    spec = load_spec(examples_dir_module / "llama2_13b_mixed.toml")
    ctx = PlanningContext(spec)
    sc = Scorer(ctx)
    dcs = ["eu-central", "eu-north"]  # A100 (PCIe, a lower plateau) then H100
    chunks = sc.split(dcs, 1, "none", 1)
    a100_units = chunks[0][0][1] - chunks[0][0][0]
    h100_units = chunks[1][0][1] - chunks[1][0][0]
    assert h100_units > 1.5 * a100_units     # a block is ~2x faster on the H100s
    costs = sc.stage_costs(dcs, chunks, 1, "none", "replicate", 8, Layout(tuple(dcs), (1, 1), 8, 1, 4))
    steps = [c.step for c in costs]
    assert max(steps) / min(steps) < 1.2  # balanced in time, not in units
    res = make_plan(spec, top_k=1)
    check_rules(spec, res.plan)


def test_infeasible_cluster_says_what_is_missing(examples_dir_module, tmp_path, capfd):
    from geotrain.cli import main

    spec = load_spec(examples_dir_module / "llama2_7b_a100_3dc.toml")
    cl = spec.cluster
    small = cl.model_validate({**cl.model_dump(), "gpu_types": {"tiny-gpu": {
        "bf16_tflops": 100, "fp16_tflops": 100, "fp32_tflops": 10, "memory_gib": 1}},
        "datacenters": [{**d.model_dump(), "gpu_type": "tiny-gpu"} for d in cl.datacenters]})
    with pytest.raises(InfeasibleError, match=r"GiB per GPU"):
        make_plan(replace(spec, cluster=small), top_k=1)
    # Through the CLI: one line, exit 2, no traceback.
    f = tmp_path / "small.toml"
    f.write_text(
        'name = "small"\nmodel = "llama2-7b"\n[job]\nglobal_batch = 64\n'
        '[cluster.gpu_types.tiny-gpu]\nbf16_tflops = 100\nfp16_tflops = 100\nfp32_tflops = 10\nmemory_gib = 1\n'
        '[[cluster.datacenters]]\nname = "a"\ngpu_type = "tiny-gpu"\ngpus = 256\n'
        '[[cluster.datacenters]]\nname = "b"\ngpu_type = "tiny-gpu"\ngpus = 256\n'
        '[[cluster.wan_links]]\nbetween = ["a", "b"]\nlatency_ms = 10\ncapacity_gbps = 10\nper_connection_gbps = 1\n')
    rc = main(["plan", str(f)])
    err = capsys_text(capfd)
    assert rc == 2
    assert "GiB per GPU" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def capsys_text(capfd) -> str:
    return capfd.readouterr().err


def test_cli_writes_a_plan_file_and_sweep_rows(examples_dir_module, tmp_path, capfd):
    from geotrain.cli import main
    from geotrain.layout.plan import load_plan
    from geotrain.planner.confirm import sweep

    out = tmp_path / "plan.json"
    assert main(["plan", str(examples_dir_module / "tiny_2dc.toml"), "--out", str(out), "--compare"]) == 0
    text = capfd.readouterr().out
    assert "lower bound" in text and "naive-pp" in text and "bottleneck" in text
    plan, doc = load_plan(out)
    assert plan.pp == 2 and plan.dp == 2 and doc["explanation"] and doc["estimate_s"] > 0
    spec = load_spec(examples_dir_module / "tiny_2dc.toml")
    rows = sweep(spec, "wan.latency_ms", ["5", "80"], top_k=1)
    assert [r.value for r in rows] == ["5", "80"]
    assert rows[1].iteration_s > rows[0].iteration_s  # more latency, slower pipeline
    assert all(math.isfinite(r.iteration_s) for r in rows)
    png = tmp_path / "sweep.png"
    assert main(["plan", str(examples_dir_module / "tiny_2dc.toml"), "--sweep", "wan.capacity_gbps=0.5,2",
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


def test_a_nearly_as_fast_plan_on_far_fewer_gpus_is_pointed_out():
    from geotrain.layout.plan import Plan, StagePlan
    from geotrain.planner.search import _cheaper_alternative

    def plan(dp, pp):
        return Plan(stages=tuple(StagePlan("a", ((i, i + 1),)) for i in range(pp)), dp=dp, micro_batch=1,
                    num_microbatches=4)

    big, small, slow = plan(8, 4), plan(4, 4), plan(2, 4)
    lines = _cheaper_alternative(big, 1.0, [(big, 1.0), (small, 1.02), (slow, 1.5)])
    assert len(lines) == 1 and "16 GPUs instead of 32" in lines[0] and "2.0% slower" in lines[0]
    assert _cheaper_alternative(big, 1.0, [(big, 1.0), (slow, 1.5)]) == []
