"""QA: a timeline of several iterations is labelled as such, not as one "iteration span"."""

from dataclasses import replace

from test_report_common import gpipe_trace, two_dc_plan

from geotrain.report.timeline import _iterations
from geotrain.trace.schema import Trace


def test_iteration_count_of_a_trace():
    plan = two_dc_plan(pp=2, dp=2, m=4)
    one = gpipe_trace(plan)
    assert _iterations(one) == 1
    shifted = [replace(e, iteration=1, start=e.start + 100, end=e.end + 100) for e in one.events]
    two = Trace(list(one.events) + shifted, num_ranks=one.num_ranks, source="sim", meta=dict(one.meta))
    assert _iterations(two) == 2


def test_multi_iteration_label(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from geotrain.report.timeline import draw_timelines

    plan = two_dc_plan(pp=2, dp=2, m=4)
    one = gpipe_trace(plan)
    shifted = [replace(e, iteration=1, start=e.start + 100, end=e.end + 100) for e in one.events]
    two = Trace(list(one.events) + shifted, num_ranks=one.num_ranks, source="sim", meta=dict(one.meta))
    titles = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (titles.extend(ax.get_title(loc="left") for ax in fig.axes),
                                                   real_close(fig)))
    draw_timelines([("predicted", two)], tmp_path / "t.png", plan)
    assert any("2 iterations in" in t for t in titles), titles
