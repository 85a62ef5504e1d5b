"""Curves a person looks at: losses.jsonl rows become curves.png and report.html's section, TensorBoard
event files in RUN_DIR/tb/ (resumes purge the recomputed steps), and the same numbers on /metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from geotrain.runtime.loss_log import LossLog


def _rows(n: int = 6) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        row = {"step": s, "loss": 5.0 - 0.1 * s, "skipped": s == 3, "loss_scale": 1.0, "step_time_s": 0.5,
               "tokens": 1024, "lr": 1e-3 * s / n, "grad_norm": 1.0 + s}
        if s % 3 == 0:
            row.update(eval_loss=4.8 - 0.1 * s, eval_perplexity=math.exp(4.8 - 0.1 * s))
        rows.append(row)
    return rows


def _log(out: Path, rows: list[dict], start: int = 0, **kw) -> LossLog:
    log = LossLog(out, True, len(rows) + start, start, 1024, 0.0, progress=False, **kw)
    for r in rows:
        extra = {k: r[k] for k in ("lr", "grad_norm", "eval_loss", "eval_perplexity") if k in r}
        log.record(r["step"], r["loss"], r["skipped"], 1.0, r["step_time_s"], **extra)
    log.close()
    return log


def _scalars(tb: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_every_curve_and_a_resume_purges_recomputed_steps(tmp_path):
    pytest.importorskip("tensorboard")
    rows = _rows()
    _log(tmp_path, rows)
    got = _scalars(tmp_path / "tb")
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/step_time_s",
            "eval/loss", "eval/perplexity"} <= set(got)
    assert [s for s, _ in got["train/loss"]] == list(range(1, 7))
    assert got["train/lr"][-1][1] == pytest.approx(1e-3)
    assert [s for s, _ in got["eval/loss"]] == [3, 6]
    assert got["train/tokens_per_s"][0][1] == pytest.approx(2048)
    # Resume at step 4 (a checkpoint there): steps 5-6 are trained again with other numbers.
    again = [dict(r, loss=9.0) for r in rows[4:]]
    _log(tmp_path, again, start=4)
    loss = dict(_scalars(tmp_path / "tb")["train/loss"])
    assert sorted(loss) == list(range(1, 7)) and loss[5] == 9.0 and loss[4] == pytest.approx(4.6)
    lines = (tmp_path / "losses.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 7))


def test_non_finite_numbers_are_written_as_null(tmp_path):
    log = LossLog(tmp_path, True, 2, 0, 1024, 0.0, progress=False, nan_policy="continue")
    log.record(1, float("nan"), False, 1.0, 0.5, grad_norm=float("inf"), lr=1e-3)
    log.close()
    row = json.loads((tmp_path / "losses.jsonl").read_text())      # strict JSON: no NaN / Infinity
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] == 1e-3


def test_curves_png_and_the_report_section(tmp_path):
    from geotrain.report.curves import draw_curves, summary_line
    from geotrain.report.html import render_html

    rows = _rows()
    (tmp_path / "losses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')
    png = draw_curves(tmp_path)
    assert png == tmp_path / "curves.png" and png.read_bytes()[:4] == b"\x89PNG"
    caption = summary_line(rows)
    assert "step 6" in caption and "eval loss 4.2000" in caption and "grad norm 7" in caption
    from geotrain.trace.metrics import Metrics

    m = Metrics(iteration_time=1.0, tokens_per_s=1.0, busy_fraction={}, mean_utilization=0.5, bubbles=[],
                link_utilization={}, wan_bytes=0)
    html = render_html(title="t", metrics=m, layout=[], curves_png=png, curves_caption=caption)
    assert "Training curves" in html and "data:image/png;base64," in html and "eval loss 4.2000" in html
    assert draw_curves(tmp_path / "nothing") is None


def test_metrics_carry_the_training_curves(tmp_path):
    from geotrain.bubbletea.prometheus import ServiceCollector

    (tmp_path / "losses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(5)))
    collector = ServiceCollector(SimpleNamespace(run_dir=str(tmp_path)))
    fams = {f.name: f.samples[0].value for f in collector._training()}
    assert fams["geotrain_train_step"] == 5 and fams["geotrain_train_loss"] == pytest.approx(4.5)
    assert fams["geotrain_train_learning_rate"] == pytest.approx(1e-3)
    assert fams["geotrain_train_grad_norm"] == pytest.approx(6.0)
    assert fams["geotrain_train_eval_loss"] == pytest.approx(4.5) and fams["geotrain_train_eval_step"] == 3
    assert fams["geotrain_train_eval_perplexity"] == pytest.approx(math.exp(4.5))
    assert fams["geotrain_train_tokens_per_second"] == pytest.approx(2048)
