import json

from geotrain.cli import main


def test_simulate_with_bubbletea_reports_and_draws(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "examples/tiny_2dc.toml", "--out", str(out), "--no-compare", "--no-progress",
               "--bubbletea", "inference_model=tiny,mean_prompt=64,min_chunk=4,iterations=10"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "GPU utilization with BubbleTea" in text and "training actions moved" in text
    doc = json.loads((out / "bubbletea.json").read_text())
    assert doc["utilization_with"] > doc["utilization_without"]
    assert (out / "bubbletea_timeline.png").stat().st_size > 10_000


def test_bad_workload_is_one_line_exit_2(tmp_path, capsys):
    rc = main(["simulate", "examples/tiny_2dc.toml", "--out", str(tmp_path), "--no-compare",
               "--bubbletea", "rate=fast"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "rate" in err


def test_plan_reports_bubbletea_headroom_and_models_that_fit(capsys):
    assert main(["plan", "examples/llama2_7b_a100_3dc.toml", "--top-k", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "BubbleTea:" in x)
    # The plan is ZB-H1 (pp=8, 8 micro-batches): every stage holds all 8 and the last ones up to 8
    # deferred weight gradients (docs/MEMORY.md), leaving ~10 GiB -- room for `small`, not a 7B model.
    assert "free beside training" in line and "inference models that fit: tiny, small" in line
    assert "llama2-7b" not in line.split("fit:")[1]
