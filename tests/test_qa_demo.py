"""QA: `geotrain demo` refuses bad flags at once, before planning, simulating or training."""

import pytest

from geotrain.cli import main


@pytest.mark.parametrize("argv, reason", [
    (["--steps", "0"], "--steps"),
    (["--steps", "-2"], "--steps"),
    (["--requests", "-1"], "--requests"),
    (["--wan", "bogus"], "invalid choice"),
])
def test_bad_demo_flags(tmp_path, capsys, argv, reason):
    out = tmp_path / "demo"
    try:
        rc = main(["demo", "--out", str(out), *argv])
    except SystemExit as e:  # argparse's own usage error
        rc = e.code
    cap = capsys.readouterr()
    assert rc == 2 and reason in cap.err
    assert "== 1/4" not in cap.out and not out.exists()
