"""One placement for pinned layouts: `plan`, `simulate` and `train` of a job that pins pp/dp give
the same stages (the planner's placement, not a proportional spread), and pins that cannot be
placed say why with each DC's numbers. Cluster: the issue's A100 DCs of 64/32/16 GPUs, tp=8."""

from __future__ import annotations

import argparse
import json

import pytest
from _small_clusters import abc_64_32_16

from geotrain.cli import main
from geotrain.errors import InfeasibleError
from geotrain.layout.plan import LinkPlan, StagePlan
from geotrain.planner.confirm import make_plan
from geotrain.planner.manual import plan_from_job, split_even
from geotrain.sim import simulate


def _train_plan(spec_path) -> list[str]:
    """The stages `geotrain train SPEC` would run (its config, before any process starts)."""
    from geotrain.commands import train_cmd as train
    from geotrain.orchestrate.training_run import load_case

    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args([str(spec_path)])
    return [s.dc for s in load_case(args.spec, train.config_from_args(args)).plan.stages]


def test_pinned_layout_is_the_same_in_plan_simulate_and_train(tmp_path, capsys):
    spec = abc_64_32_16(tmp_path / "spec", dp=2, pp=6, tp=8)
    chosen = make_plan(spec).plan
    stages = [s.dc for s in chosen.stages]
    assert (chosen.pp, chosen.dp, chosen.tp) == (6, 2, 8)
    assert main(["simulate", str(spec.path), "--out", str(tmp_path / "sim"), "--no-compare", "--no-progress",
                 "--no-timeline"]) == 0
    capsys.readouterr()
    simulated = [s["dc"] for s in json.loads((tmp_path / "sim" / "plan.json").read_text())["plan"]["stages"]]
    assert simulated == stages
    assert _train_plan(spec.path) == stages
    # Not the old proportional spread, which the simulator scores far slower.
    spread = ["A", "A", "A", "B", "B", "C"]
    assert stages != spread
    links = tuple(LinkPlan(src_dc=a, dst_dc=b, connections=spec.cluster.link(a, b).connections_to_saturate())
                  for a, b in (("A", "B"), ("B", "C")))
    old = chosen.with_(stages=tuple(StagePlan(dc=d, chunks=(r,)) for d, r in zip(spread, split_even(
        spec.model.num_units, 6))), links=links, schedule="1f1b", extra_warmup=(), pipeline_offsets=())
    # (0.86x since the simulator counts a boundary's copy to each of the 8 receiving TP ranks)
    assert simulate(spec, chosen).metrics.iteration_time < 0.9 * simulate(spec, old).metrics.iteration_time


def test_dp4_pp3_fits_as_a_a_b(tmp_path):
    """32 GPUs per stage: A holds two stages, B one, C none -- a spread that insists on every DC
    refused this job."""
    spec = abc_64_32_16(tmp_path, dp=4, pp=3, tp=8)
    plan = plan_from_job(spec)
    assert sorted(s.dc for s in plan.stages) == ["A", "A", "B"]
    assert sorted(s.dc for s in make_plan(spec).plan.stages) == ["A", "A", "B"]


def test_infeasible_pins_show_each_dcs_arithmetic(tmp_path):
    spec = abc_64_32_16(tmp_path, dp=3, pp=4, tp=8, global_batch=48)
    for fn in (plan_from_job, make_plan):
        with pytest.raises(InfeasibleError) as e:
            fn(spec)
        msg = str(e.value)
        assert "24 GPUs each" in msg
        assert "A 64 // 24 = 2, B 32 // 24 = 1, C 16 // 24 = 0" in msg
        assert "holds 3 < 4" in msg


def test_pinned_zb_h1_with_selective_checkpointing_says_why(tmp_path, capsys):
    spec = abc_64_32_16(tmp_path, schedule="zb-h1", checkpointing="selective")
    for fn in (plan_from_job, make_plan):
        with pytest.raises(InfeasibleError, match="zb-h1 cannot run with selective checkpointing"):
            fn(spec)
    assert main(["plan", str(spec.path)]) == 2
    err = capsys.readouterr().err
    assert "selective checkpointing" in err and "Traceback" not in err


def test_a_pinned_job_never_gets_a_baseline_that_breaks_its_pins(tmp_path):
    """The baselines choose their own dp; naive-pp used to win a pinned dp=2 job with dp=16."""
    spec = abc_64_32_16(tmp_path, dp=2, pp=6)
    res = make_plan(spec)
    assert (res.plan.pp, res.plan.dp) == (6, 2)
    assert all(not name.startswith("naive-pp") for name, _, _ in res.finalists)
