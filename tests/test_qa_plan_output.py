"""QA: `geotrain plan` prints human units (ms, KiB) like simulate and report do -- it printed
"0.048 s", "0.00 GiB" and "2089.5 ms" -- and says why "memory" is the bottleneck."""

import re

from geotrain.cli import main


def test_tiny_plan_uses_human_units(capsys):
    assert main(["plan", "examples/tiny_2dc.toml", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "0.00 GiB" not in out and "0.0 GiB" not in out and "0.0 MiB" not in out
    assert not re.search(r"\b0\.0\d\d s\b", out), out           # no "0.048 s" for 48 ms
    assert re.search(r"simulated \d+(\.\d+)? ms", out)
    assert "WAN bytes/iteration 256 KiB" in out
    assert re.search(r"geotrain +\d+(\.\d+)? ms", out)            # the compare table too


def test_memory_bottleneck_is_explained(capsys):
    assert main(["plan", "examples/llama2_70b_unequal.toml", "--top-k", "1"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck: memory" in out
    memory = next(line for line in out.splitlines() if "Memory:" in line)
    assert "this is the bottleneck" in memory and "job pins checkpointing 'full'" in memory


def test_single_dc_baseline_says_the_pinned_layout_is_too_big():
    from geotrain.planner.baselines import single_dc
    from geotrain.planner.context import PlanningContext
    from geotrain.spec import load_spec

    spec = load_spec("examples/tiny_2dc.toml")    # pins pp=2 x dp=2; each DC has 2 GPUs
    plan, note = single_dc(spec, PlanningContext(spec))
    assert plan is None and "pp=2 x dp=2 = 4 GPUs" in note and "has 2" in note
