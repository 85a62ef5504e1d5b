"""QA: `geotrain plan --sweep` -- bad values and plot paths are one-line errors, the plot keeps
one colour per baseline in both panels, and a sweep with nothing feasible still draws."""

import math

import pytest

from geotrain.cli import main
from geotrain.errors import GeotrainError
from geotrain.planner.whatif import SweepRow, apply_value, plot

TINY = "examples/tiny_2dc.toml"


def _one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


def test_fractional_gpu_count_is_refused():
    from geotrain.spec import load_spec

    with pytest.raises(GeotrainError, match="whole number"):
        apply_value(load_spec(TINY), "dc.east.gpus", "1.5")


@pytest.mark.parametrize("extra, reason", [
    (["--plot", "x.txt"], "unknown picture format"),
    (["--plot", "/nonexistent-dir-qa/x.png"], "does not exist"),
    (["--out", "p.json"], "--out writes one plan file"),
])
def test_sweep_flag_errors(capsys, tmp_path, monkeypatch, extra, reason):
    monkeypatch.chdir(tmp_path)
    from pathlib import Path

    spec = str(Path(__file__).resolve().parents[1] / TINY)
    assert reason in _one_line_error(capsys, ["plan", spec, "--sweep", "wan.latency_ms=5", *extra])
    assert not (tmp_path / "p.json").exists()


def test_plot_with_nothing_feasible(tmp_path):
    rows = [SweepRow("1", math.inf, 0.0, "-", note="cannot be placed")]
    plot(rows, "dc.east.gpus", str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").stat().st_size > 0


def test_baseline_keeps_its_colour_in_both_panels(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    seen = {}
    real_close = plt.close

    def keep(fig):
        for ax in fig.axes:
            for line in ax.get_lines():
                name = line.get_label().removeprefix("vs ")
                if not name.startswith("_") and name != "geotrain plan":
                    seen.setdefault(name, set()).add(line.get_color())
        real_close(fig)

    monkeypatch.setattr(plt, "close", keep)
    rows = [SweepRow(v, 1.0, 1.0, "x", {"a": 2.0, "b": 3.0, "c": math.inf}) for v in ("5", "20")]
    plot(rows, "wan.latency_ms", str(tmp_path / "s.png"))
    assert set(seen) == {"a", "b", "c"}
    assert all(len(colors) == 1 for colors in seen.values()), seen
