"""QA: `geotrain estimate` on a job that leaves the layout to the planner says that the layout
it shows is a default (the 8k example showed pp=4 x dp=1024 "does NOT fit" with no hint why)."""

from geotrain.cli import main


def test_auto_job_gets_a_note(capsys):
    assert main(["estimate", "examples/llama2_70b_4dc_8k.toml"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note:"))
    assert "pp, dp, micro_batch, schedule, checkpointing, sharding" in note and "geotrain plan" in note


def test_pinned_job_has_no_note(capsys):
    assert main(["estimate", "examples/tiny_2dc.toml"]) == 0
    assert "note:" not in capsys.readouterr().out
