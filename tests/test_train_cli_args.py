"""geotrain train argument checks that must fail before any process starts."""

from geotrain.cli import main


def test_resume_without_a_checkpoint_is_refused_and_keeps_the_record(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "losses.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    rc = main(["train", "examples/tiny_2dc.toml", "--out", str(run), "--resume", "--wan", "off"])
    err = capsys.readouterr().err
    assert rc == 2 and "no complete checkpoint" in err and len(err.strip().splitlines()) == 1
    assert (run / "losses.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def test_negative_checkpoint_interval_is_refused(tmp_path, capsys):
    rc = main(["train", "examples/tiny_2dc.toml", "--out", str(tmp_path), "--checkpoint-every", "-1"])
    assert rc == 2 and "--checkpoint-every" in capsys.readouterr().err


def test_wan_tls_without_a_wan_or_without_cryptography_is_refused_before_any_rank_starts(tmp_path, capsys,
                                                                                         monkeypatch):
    import sys

    rc = main(["train", "examples/tiny_2dc.toml", "--out", str(tmp_path / "a"), "--wan", "off", "--wan-tls"])
    err = capsys.readouterr().err
    assert rc == 2 and "--wan off sends plain" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "cryptography", None)          # as if the tls extra were not installed
    rc = main(["train", "examples/tiny_2dc.toml", "--out", str(tmp_path / "b"), "--wan", "shaper", "--wan-tls"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'geotrain[tls]'" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b" / "logs").exists()
