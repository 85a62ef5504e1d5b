"""QA: `simulate --bubbletea WORKLOAD` refuses out-of-range workloads in one line, before it
simulates or writes anything, and never reports a TTFT when nothing was served."""

import pytest

from geotrain.bubbletea.simulated import BubbleTeaResult, parse_workload
from geotrain.cli import main
from geotrain.errors import SpecError


@pytest.mark.parametrize("text, key", [
    ("load=-1", "load"), ("load=0", "load"), ("rate_per_s=-3", "rate_per_s"), ("rate_per_s=0", "rate_per_s"),
    ("sigma=-1", "sigma"), ("mean_prompt=0", "mean_prompt"), ("max_prompt=-5", "max_prompt"),
    ("iterations=0", "iterations"), ("margin_frac=2", "margin_frac"), ("min_chunk=0", "min_chunk"),
    ("max_wait_periods=-1", "max_wait_periods"), ("representative_replicas=0", "representative_replicas"),
    ("load=nan", "load"),
])
def test_out_of_range_values(text, key):
    with pytest.raises(SpecError, match=key):
        parse_workload(text)


def test_good_values_still_parse():
    cfg = parse_workload("load=0.5,mean_prompt=64,max_prompt=128,iterations=2,margin_frac=0")
    assert (cfg.load, cfg.mean_prompt, cfg.iterations) == (0.5, 64, 2)


def test_bad_workload_is_refused_before_simulating(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "examples/tiny_2dc.toml", "--out", str(out), "--no-compare", "--bubbletea", "load=-1"])
    cap = capsys.readouterr()
    assert rc == 2 and len(cap.err.strip().splitlines()) == 1 and "load" in cap.err
    assert "iteration time" not in cap.out and not (out / "trace.jsonl").exists()


def test_unwritable_out_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["simulate", "examples/tiny_2dc.toml", "--out", str(blocker / "sub"), "--no-compare"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot create" in err[0]


def test_no_ttft_when_nothing_served():
    r = BubbleTeaResult(utilization_without=0.1, utilization_with=0.1, served=0, refused=2, ttft_p50=0.0,
                        ttft_p99=0.0, prefill_tokens_per_s=0.0, period=0.05, horizon=0.25, requests=2)
    rows = dict(r.summary_rows())
    assert "0 ms" not in rows["TTFT p50 / p99"]
    r.served, r.ttft_p50, r.ttft_p99 = 5, 3.147, 5.05
    assert dict(r.summary_rows())["TTFT p50 / p99"] == "3.15 s / 5.05 s"


def test_default_example_serves_requests(tmp_path, capsys):
    import json

    out = tmp_path / "bt"
    assert main(["simulate", "examples/tiny_2dc.toml", "--out", str(out), "--no-compare", "--bubbletea"]) == 0
    capsys.readouterr()
    doc = json.loads((out / "bubbletea.json").read_text())
    assert doc["served"] > 0 and doc["utilization_with"] > doc["utilization_without"]
