"""QA: `geotrain simulate` on a spec that pins no layout simulates the plan `geotrain plan`
chooses; it used to take the estimate-only pick, a different layout (pp=8 x dp=128 instead of
pp=16 x dp=64 for the 7B example)."""

import json

from geotrain.cli import main
from geotrain.planner.confirm import make_plan
from geotrain.spec import load_spec

SPEC = "examples/llama2_7b_a100_3dc.toml"


def test_simulate_uses_the_planners_choice(tmp_path, capsys):
    chosen = make_plan(load_spec(SPEC)).plan
    assert main(["simulate", SPEC, "--out", str(tmp_path), "--no-compare", "--no-progress", "--no-timeline"]) == 0
    capsys.readouterr()
    got = json.loads((tmp_path / "plan.json").read_text())["plan"]
    assert (len(got["stages"]), got["dp"], got["micro_batch"], got["schedule"]) == \
        (chosen.pp, chosen.dp, chosen.micro_batch, chosen.schedule)
    assert [s["dc"] for s in got["stages"]] == [s.dc for s in chosen.stages]
