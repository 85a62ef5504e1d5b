"""HTML page and predicted-vs-measured comparison on hand-built traces with known numbers."""

from __future__ import annotations

import math

import pytest
from test_report_common import gpipe_trace, two_dc_plan

from geotrain.console import human_seconds
from geotrain.report.build import build_report
from geotrain.report.compare import compare_traces
from geotrain.trace.metrics import compute_metrics


def gpipe_iteration(pp, m, tf, tb, comm, ar, opt):
    """Closed form of the fixture: last forward ends, backwards drain through the pipeline, then
    stage 0 reduces and steps."""
    t_f_end = (m - 1) * tf + (pp - 1) * (tf + comm) + tf
    return t_f_end + (m - 1) * tb + (pp - 1) * (tb + comm) + tb + ar + opt


def test_compare_traces_relative_error():
    plan = two_dc_plan(pp=4, dp=2, m=6)
    pred = gpipe_trace(plan)
    meas = gpipe_trace(plan, slow=1.25, source="measured")
    rows = {r.metric: r for r in compare_traces(pred, meas, tokens_per_iteration=1000)}
    t_pred = gpipe_iteration(4, 6, 1.0, 2.0, 0.5, 0.3, 0.2)
    t_meas = gpipe_iteration(4, 6, 1.25, 2.5, 0.625, 0.3, 0.2)
    it = rows["iteration time"]
    assert it.predicted == pytest.approx(t_pred) and it.measured == pytest.approx(t_meas)
    assert it.rel_error == pytest.approx((t_pred - t_meas) / t_meas)
    assert rows["tokens/s"].measured == pytest.approx(1000 / t_meas)
    # Utilization: training compute (fwd + bwd + optimizer) per rank / iteration time.
    util_pred = (6 * 1.0 + 6 * 2.0 + 0.2) / t_pred
    assert rows["mean utilization"].predicted == pytest.approx(util_pred)
    assert rows["WAN bytes per iteration"].rel_error == 0.0
    assert {"bubble time per GPU per iteration", "bubble fraction"} <= set(rows)


def test_html_contains_metrics(tmp_path):
    plan = two_dc_plan(pp=2, dp=2, m=4)
    trace = gpipe_trace(plan, tf=0.01, tb=0.02, comm=0.005, ar=0.003, opt=0.002)
    peak = {r: 3 * 2**30 for r in range(plan.num_ranks)}
    m = compute_metrics(trace, 4096, peak)
    files = build_report(tmp_path, trace, m, plan=plan, gpu_memory={"east": 2 * 2**30, "west": 80 * 2**30})
    html = files.html.read_text()
    t = gpipe_iteration(2, 4, 0.01, 0.02, 0.005, 0.003, 0.002)
    assert m.iteration_time == pytest.approx(t)
    assert human_seconds(t) in html
    assert f"{100 * m.mean_utilization:.1f}%" in html
    assert "east-&gt;west" in html and "west-&gt;east" in html       # per-link table
    assert "over GPU memory" in html                                  # 3 GiB on a 2 GiB GPU is flagged
    assert "<h2>Plan" in html and "data:image/png;base64," in html
    assert "Predicted vs measured" not in html
    assert files.timeline.exists() and files.timeline.stat().st_size > 5000


def test_html_with_measured_trace(tmp_path):
    plan = two_dc_plan(pp=2, dp=2, m=4)
    pred = gpipe_trace(plan)
    meas = gpipe_trace(plan, slow=2.0, source="measured")
    files = build_report(tmp_path, pred, compute_metrics(pred, 100), plan=plan, measured=meas,
                         tokens_per_iteration=100)
    html = files.html.read_text()
    assert "Predicted vs measured" in html
    it = next(r for r in files.comparison if r.metric == "iteration time")
    assert not math.isnan(it.rel_error) and f"{100 * it.rel_error:+.1f}%" in html
