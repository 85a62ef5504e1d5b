"""`geotrain simulate` end to end on the tiny example, `geotrain report` on its directory (with
and without a measured trace), and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from geotrain.cli import main
from geotrain.schedule.builders import BUILDERS
from geotrain.trace.metrics import compute_metrics
from geotrain.trace.schema import Trace


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory, request):
    from conftest import EXAMPLES

    out = tmp_path_factory.mktemp("sim")
    assert main(["simulate", str(EXAMPLES / "tiny_2dc.toml"), "--out", str(out), "--no-progress"]) == 0
    return out


def test_simulate_writes_everything(sim_dir):
    for name in ("trace.jsonl", "trace.chrome.json", "timeline.png", "report.html", "metrics.json", "plan.json"):
        assert (sim_dir / name).stat().st_size > 100, name
    trace = Trace.read_jsonl(sim_dir / "trace.jsonl")
    doc = json.loads((sim_dir / "metrics.json").read_text())
    m = compute_metrics(trace, doc["tokens_per_iteration"])
    assert doc["iteration_time_s"] == pytest.approx(m.iteration_time)
    assert doc["tokens_per_s"] == pytest.approx(m.tokens_per_s)
    chrome = json.loads((sim_dir / "trace.chrome.json").read_text())
    assert sum(1 for e in chrome["traceEvents"] if e["ph"] == "X") == len(trace.events)
    # Every registered schedule kind is compared (simulated or marked not applicable).
    kinds = [r["kind"] for r in doc["schedule_comparison"]]
    assert kinds == list(BUILDERS)
    mine = next(r for r in doc["schedule_comparison"] if r["kind"] == "1f1b")
    assert mine["iteration_time"] == pytest.approx(m.iteration_time)
    html = (sim_dir / "report.html").read_text()
    assert "Schedule kinds on this layout" in html and "east" in html


def test_simulate_summary_printed(tmp_path, capsys):
    from conftest import EXAMPLES

    rc = main(["simulate", str(EXAMPLES / "tiny_2dc.toml"), "--out", str(tmp_path / "o"), "--no-compare",
               "--schedule", "gpipe", "--iterations", "2", "--no-timeline"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "gpipe" in out and "iteration time" in out and "report.html" in out
    # --no-timeline: the page without the picture (test_simulate_writes_everything draws it)
    assert not (tmp_path / "o" / "timeline.png").exists() and "timeline.png" not in out
    assert "data:image/png" not in (tmp_path / "o" / "report.html").read_text()
    assert not (json.loads((tmp_path / "o" / "metrics.json").read_text())).get("schedule_comparison")
    trace = Trace.read_jsonl(tmp_path / "o" / "trace.jsonl")
    assert {e.iteration for e in trace.events} == {0, 1}


def test_report_rebuilds_and_compares(sim_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(sim_dir, run)
    (run / "report.html").unlink()
    (run / "timeline.png").unlink()
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").exists() and (run / "timeline.png").exists()
    assert "Predicted vs measured" not in (run / "report.html").read_text()

    # A "measured" trace 10% slower than predicted: the relative error must say so.
    trace = Trace.read_jsonl(run / "trace.jsonl")
    for e in trace.events:
        e.start, e.end = e.start * 1.1, e.end * 1.1
    trace.source = "measured"
    trace.write_jsonl(run / "measured_trace.jsonl")
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("iteration time") and "%" in x)
    assert line.rstrip().endswith(f"{100 * (1 / 1.1 - 1):+.1f}%")
    assert "Predicted vs measured" in (run / "report.html").read_text()


@pytest.mark.parametrize("argv", [
    ["simulate", "does-not-exist.toml", "--out", "{tmp}/x"],
    ["simulate", "{examples}/tiny_2dc.toml", "--out", "{tmp}/x", "--schedule", "nope"],
    ["simulate", "{examples}/tiny_2dc.toml", "--out", "{tmp}/x", "--iterations", "0"],
    ["simulate", "{examples}/tiny_2dc.toml", "--out", "{tmp}/x", "--plan", "{tmp}/missing.json"],
    ["report", "{tmp}"],
    ["report", "{tmp}/nothing-here"],
    ["report", "{tmp}/garbage"],
])
def test_bad_input_is_one_line_exit_2(argv, tmp_path, capsys):
    from conftest import EXAMPLES

    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "trace.jsonl").write_text("{not json\n")
    argv = [a.format(tmp=tmp_path, examples=EXAMPLES) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"geotrain {argv[0]}: error:") and "\n" not in err


def test_plan_file_for_another_cluster_or_model_is_refused(tmp_path, capsys):
    from conftest import EXAMPLES

    from geotrain.layout.plan import StagePlan, save_plan
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec import load_spec

    spec = load_spec(EXAMPLES / "tiny_2dc.toml")
    plan = plan_from_job(spec)
    save_plan(tmp_path / "ok.json", plan)
    assert main(["simulate", str(EXAMPLES / "tiny_2dc.toml"), "--out", str(tmp_path / "o"), "--plan",
                 str(tmp_path / "ok.json"), "--no-compare"]) == 0
    bad_dc = plan.with_(stages=(StagePlan("mars", plan.stages[0].chunks),) + plan.stages[1:])
    short = plan.with_(stages=(plan.stages[0], StagePlan(plan.stages[1].dc, ((3, 4),))))
    for name, p, words in (("dc", bad_dc, "'mars'"), ("units", short, "units")):
        save_plan(tmp_path / f"{name}.json", p)
        capsys.readouterr()
        assert main(["simulate", str(EXAMPLES / "tiny_2dc.toml"), "--out", str(tmp_path / "o"), "--plan",
                     str(tmp_path / f"{name}.json"), "--no-compare"]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err
