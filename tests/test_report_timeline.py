"""Timeline pictures: written, sized by rank count, coloured by kind, subset above max_rows."""

from __future__ import annotations

import matplotlib.image as mpimg
import numpy as np
from matplotlib.colors import to_rgb
from test_report_common import gpipe_trace, two_dc_plan

from geotrain.report.timeline import KIND_STYLE, draw_timeline, draw_timelines, select_rows


def _has_colour(img: np.ndarray, hex_colour: str, min_pixels: int = 50) -> bool:
    rgb = np.array(to_rgb(hex_colour))
    close = np.all(np.abs(img[..., :3] - rgb) < 0.02, axis=-1)
    return int(close.sum()) >= min_pixels


def test_timeline_png(tmp_path):
    plan = two_dc_plan(pp=4, dp=2, m=6)
    png = draw_timeline(gpipe_trace(plan), tmp_path / "t.png", plan, title="test")
    img = mpimg.imread(png)
    h, w = img.shape[:2]
    assert png.stat().st_size > 10_000
    assert 1400 <= w <= 1700 and 400 <= h <= 1400
    for kind in ("forward", "backward", "recv_wait", "allreduce", "optimizer", "transfer"):
        assert _has_colour(img, KIND_STYLE[kind][0]), kind
    assert not _has_colour(img, KIND_STYLE["backward_weight"][0])   # no such events in a GPipe trace


def test_stacked_timelines_are_taller(tmp_path):
    plan = two_dc_plan(pp=2, dp=2, m=4)
    one = mpimg.imread(draw_timeline(gpipe_trace(plan), tmp_path / "a.png", plan))
    two = mpimg.imread(draw_timelines([("predicted", gpipe_trace(plan)),
                                       ("measured", gpipe_trace(plan, slow=1.3, source="measured"))],
                                      tmp_path / "b.png", plan))
    assert two.shape[0] > 1.5 * one.shape[0]


def test_many_ranks_draw_a_few_replicas_of_each_stage(tmp_path):
    plan = two_dc_plan(pp=8, dp=64, m=8)      # 512 ranks
    trace = gpipe_trace(plan)
    rows = select_rows(trace, plan, max_rows=256)
    assert rows.ranks == [plan.rank(s, d) for s in range(8) for d in (0, 21, 42, 63)]
    assert "512" in rows.note and "replicas 0, 21, 42, 63" in rows.note
    rows = select_rows(trace, plan, max_rows=8)
    assert rows.ranks == [plan.rank(s, 0) for s in range(8)] and "replica 0 of each" in rows.note
    img = mpimg.imread(draw_timeline(trace, tmp_path / "big.png", plan))
    assert img.shape[0] < 1500                 # 32 rows + links, not 512
    rows = select_rows(trace, plan, max_rows=1000)
    assert len(rows.ranks) == 512 and rows.note == ""
