"""The ranking harness (calibrate.ranking): arms alternate, predictions come first, ratios are of medians."""

from __future__ import annotations

import pytest

from geotrain.calibrate.ranking import PAIRS, Pair, PairResult, ranking_markdown, run_order, run_ranking


def test_arms_alternate_and_never_run_twice_in_a_row():
    order = run_order(PAIRS, 4)
    assert len(order) == 2 * 4 * len(PAIRS)
    assert all(x[:2] != y[:2] for x, y in zip(order, order[1:]))          # no arm twice in a row
    for i in range(len(PAIRS)):                                            # each pair: A B A B A B A B
        assert [arm for p, arm, _ in order if p == i] == ["a", "b"] * 4


def test_the_harness_predicts_first_then_runs_in_that_order(tmp_path):
    calls = []
    pairs = [Pair("x", PAIRS[0].a, PAIRS[0].b), Pair("y", PAIRS[2].a, PAIRS[2].b)]
    times = {"gpipe": [0.30, 0.10, 0.32], "1f1b": [0.20, 0.20, 0.21], "narrow-1": [1.0] * 3, "narrow-4": [0.5] * 3}

    def predictor(case, directory):
        calls.append(("predict", case.name))
        return {"gpipe": 0.3, "1f1b": 0.2, "narrow-1": 0.9, "narrow-4": 0.5}[case.name]

    def runner(case, directory):
        calls.append(("run", case.name))
        return times[case.name].pop(0)

    res = run_ranking(pairs, 3, tmp_path, predictor, runner, say=lambda _: None)
    assert [c for c, _ in calls[:4]] == ["predict"] * 4 and all(c == "run" for c, _ in calls[4:])
    assert [n for _, n in calls[4:]] == ["gpipe", "1f1b", "narrow-1", "narrow-4"] * 3
    assert res[0].measured_ratio == pytest.approx(0.30 / 0.20)              # medians, not means
    assert res[0].predicted_ratio == pytest.approx(1.5) and res[0].ordered_right
    assert res[1].ratio_error == pytest.approx(1.8 / 2.0 - 1)
    md = ranking_markdown(res, 3, 1.0)
    assert "2 of 2 pairs whose predicted gap is over 10 % ordered right" in md


def test_a_wrong_order_is_reported():
    r = PairResult("z", "a", "b", predicted_a=1.0, predicted_b=1.5, measured_a=[2.0], measured_b=[1.0])
    assert not r.ordered_right and "NO" in ranking_markdown([r], 1, 0.0)
