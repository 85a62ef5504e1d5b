"""QA: `geotrain train` on a plan made for a real cluster refuses at once instead of spawning
one local process per rank (1,536 for the 7B example) until the machine chokes."""

import pytest

from geotrain.errors import GeotrainError
from geotrain.runtime.launch import check_local_world_size, launch


def test_too_many_local_ranks_is_refused(tmp_path):
    with pytest.raises(GeotrainError, match="1536 ranks"):
        launch([], 1536, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_limit_can_be_raised(monkeypatch):
    check_local_world_size(8)
    monkeypatch.setenv("GEOTRAIN_MAX_LOCAL_RANKS", "2000")
    check_local_world_size(1536)
    monkeypatch.setenv("GEOTRAIN_MAX_LOCAL_RANKS", "many")
    with pytest.raises(GeotrainError, match="must be an integer"):
        check_local_world_size(4)


def test_train_cli_one_line(tmp_path, capsys):
    from geotrain.cli import main

    rc = main(["train", "examples/llama2_7b_a100_3dc.toml", "--steps", "3", "--out", str(tmp_path / "run"),
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "ranks" in err[0]
    assert not (tmp_path / "run").exists()
