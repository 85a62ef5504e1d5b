import pytest

from geotrain.bubbletea.predictor import BubblePredictor


def test_budget_is_the_smallest_recent_idle_minus_margins():
    p = BubblePredictor(margin_frac=0.5, margin_s=0.01, history=2, warmup_iterations=1)
    p.record(3, 0.10, False)
    assert p.budget(3) == 0.0          # still warming up
    p.next_iteration()
    assert p.budget(3) == pytest.approx(0.04)
    p.record(3, 0.06, False)
    assert p.budget(3) == pytest.approx(0.02)
    p.record(3, 0.5, False)
    p.record(3, 0.5, False)            # the small one left the history window
    assert p.budget(3) == pytest.approx(0.24)
    assert p.budget(4) == 0.0          # never idle there


def test_overrun_halves_that_position_only():
    p = BubblePredictor(margin_frac=0.0, margin_s=0.0, warmup_iterations=0)
    p.record(1, 0.2, False)
    p.record(2, 0.2, True)
    assert p.budget(1) == pytest.approx(0.2)
    assert p.budget(2) == pytest.approx(0.1)


def test_a_missed_position_wins_its_budget_back_over_clean_iterations():
    p = BubblePredictor(margin_frac=0.0, margin_s=0.0, warmup_iterations=0)
    p.record(2, 0.2, True)
    p.record(2, 0.2, True)
    p.next_iteration()
    assert p.budget(2) == pytest.approx(0.05)
    p.next_iteration()                 # a clean iteration
    assert p.budget(2) == pytest.approx(0.0625)
    for _ in range(10):
        p.next_iteration()
    assert p.budget(2) == pytest.approx(0.2)
    p.record(2, 0.2, True)
    p.next_iteration()                 # missed again in this iteration: no recovery
    assert p.budget(2) == pytest.approx(0.1)
