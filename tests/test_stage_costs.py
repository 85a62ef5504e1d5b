"""The one cost interface (layout.stage_costs): analytic and calibrated costs come from one code
path, so they agree on everything both model."""

from __future__ import annotations

import dataclasses

import pytest

from geotrain.calibrate.calibrated_costs import predict
from geotrain.calibrate.profile_file import cost_profile
from geotrain.costs import CostModel
from geotrain.planner.manual import plan_from_job
from geotrain.sim import simulate

# Fixed unit times (s per micro-batch of 2): what `geotrain profile` measures first, and nothing else.
UNITS_ONLY = {"embedding": {"2": [1e-3, 2e-3]}, "block": {"2": [3e-3, 6e-3]}, "head": {"2": [2e-3, 4e-3]},
              "runtime": {}}


@pytest.fixture(scope="module")
def tied_spec(tmp_path_factory):
    from geotrain.calibrate.cases import Case, write_spec

    spec = write_spec(Case("tied", dp=2, latency_ms=5, per_connection_mbps=100), tmp_path_factory.mktemp("spec"))
    return dataclasses.replace(spec, model=spec.model.model_copy(update={"tie_embeddings": True}))


def test_calibrated_costs_agree_with_the_analytic_ones_on_what_both_model(tied_spec):
    """A profile that measures only unit times: the calibrated prediction is the analytic
    simulation with those unit times -- the TP all-reduces and the tied embedding's gradient sum
    included (the calibrated inputs once had neither, and priced a tp = 2 stage at tp = 1)."""
    plan = plan_from_job(tied_spec).with_(tp=2)          # pp=2 over east/west x dp=2, tp=2, tied
    cost = CostModel(tied_spec.model, precision=plan.precision, checkpointing=plan.checkpointing,
                     optimizer=tied_spec.job.optimizer, profile=cost_profile(UNITS_ONLY))
    analytic = simulate(tied_spec, plan, iterations=2, cost=cost)
    calibrated, det = predict(tied_spec, plan, UNITS_ONLY, iterations=2, contention=False, mode="kernel")

    def durations(res, kind):
        return sorted((e.rank, e.stage, e.mb, e.iteration, e.duration) for e in res.trace.events if e.kind == kind)

    for kind in ("forward", "backward", "allreduce", "optimizer"):
        got, want = durations(calibrated, kind), durations(analytic, kind)
        assert [x[:4] for x in got] == [x[:4] for x in want], kind
        assert [x[4] for x in got] == pytest.approx([x[4] for x in want], rel=1e-12), kind
    # Both run gradient clipping's norm exchange as messages (StageCosts.norm_exchange; calibrate.waits:
    # the calibrated hand-off on every edge), no step-wide collective in bf16: both cost the same
    # beyond an unclipped job, to the hand-off's difference per message.
    assert det["global_sync_s"] == 0
    unclipped = dataclasses.replace(tied_spec, job=tied_spec.job.model_copy(update={"grad_clip": 0.0}))
    base = simulate(unclipped, plan, iterations=2, cost=cost)
    assert analytic.iteration_time > base.iteration_time and calibrated.iteration_time > base.iteration_time
    assert calibrated.iteration_time == pytest.approx(analytic.iteration_time, abs=2e-4)
    # ... and both price what they claim: a TP term in the compute, the tied sum in the sync.
    tp1 = simulate(tied_spec, plan.with_(tp=1), iterations=2, cost=cost)
    assert durations(analytic, "forward")[0][-1] > durations(tp1, "forward")[0][-1] / 2
    untied = dataclasses.replace(tied_spec, model=tied_spec.model.model_copy(update={"tie_embeddings": False}))
    plain = simulate(untied, plan, iterations=2, cost=CostModel(untied.model, precision=plan.precision,
                                                                 profile=cost_profile(UNITS_ONLY)))
    assert durations(analytic, "allreduce")[0][-1] > durations(plain, "allreduce")[0][-1]
