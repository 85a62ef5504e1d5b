"""A run cleans up after itself and keeps to its own directory (issue #30): a second run into a run
directory in use is refused in one line, a dead run's lock is taken over; kill -9 of the launcher
leaves no secret or socket after the next start; a WAN outage is said on the console, not only in
the rank logs."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _cli import geotrain

from geotrain.errors import GeotrainError
from geotrain.process import private_dir, sweep_private_dirs
from geotrain.runtime.log_echo import OutageEcho
from geotrain.runtime.run_lock import run_dir_lock

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_run_directory_in_use_is_refused_and_a_dead_runs_lock_taken_over(tmp_path):
    run, said = tmp_path / "run", []
    with run_dir_lock(run, say=said.append):
        with pytest.raises(GeotrainError, match=rf"in use by another run \(pid {os.getpid()} on "):
            with run_dir_lock(run):
                pass
    assert said == []
    (run / ".geotrain.lock").write_text(f"pid {_dead_pid()} on elsewhere, since yesterday\n")   # no flock held
    with run_dir_lock(run, say=said.append):
        pass
    assert len(said) == 1 and "took over the lock of a run that is no longer running (pid" in said[0], said


def test_private_folders_of_dead_processes_are_swept_and_live_ones_kept(tmp_path):
    mine = private_dir("test")
    dead = Path(tempfile.mkdtemp(prefix=f"geotrain-test-{_dead_pid()}-"))
    (dead / "secret").write_text("ab" * 16)
    try:
        gone = sweep_private_dirs()
        assert dead in gone and not dead.exists() and mine.is_dir()
        assert oct(mine.stat().st_mode & 0o777) == "0o700"
    finally:
        mine.rmdir()


def test_outage_lines_of_the_rank_logs_are_said_on_the_console(tmp_path):
    for r in range(2):
        (tmp_path / f"rank{r}.log").write_text("training...\n")
    out = io.StringIO()
    echo = OutageEcho(tmp_path, 2, out=out)
    with open(tmp_path / "rank1.log", "a") as f:
        f.write("geotrain wan: rank 1: recv from rank 0 (east) (tag 3, 16384 bytes): no progress for 30 s, still "
                "waiting (gives up after 300 s)\n")
        f.write("geotrain wan: rank 1 (west) -> stage 0 (east): StripedTransport, 4 connections\n")   # not an outage
        f.write("geotrain wan: rank 1: link to rank 0 (east): connection lost (reset); reconnecting to resen")
    echo.poll(force=True)
    with open(tmp_path / "rank1.log", "a") as f:
        f.write("d 1 message(s)\n")
    echo.poll(force=True)
    echo.poll(force=True)
    lines = out.getvalue().splitlines()
    assert lines == ["geotrain wan: rank 1: recv from rank 0 (east) (tag 3, 16384 bytes): no progress for 30 s, "
                     "still waiting (gives up after 300 s)",
                     "geotrain wan: rank 1: link to rank 0 (east): connection lost (reset); reconnecting to resend 1 "
                     "message(s)"], lines


def _procs_of(launcher: int) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"GEOTRAIN_LAUNCHER_PID={launcher}".encode() in env:
                out.append(int(proc.name))
    return out


def _private(pid: int) -> list[Path]:
    return sorted(Path(tempfile.gettempdir()).glob(f"geotrain-*-{pid}-*"))


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_secret_or_socket_after_the_next_start(tmp_path, capfd, monkeypatch,
                                                                                request):
    run, spec = tmp_path / "run", tmp_path / "one_rank.toml"       # one rank: the launcher is what matters
    # A temporary directory of its own: any geotrain started elsewhere on the machine sweeps the shared
    # one and could take the dead run's folders before this test looks (a short path: a Unix socket's limit)
    own_tmp = tempfile.mkdtemp(prefix="gt-")
    request.addfinalizer(lambda: shutil.rmtree(own_tmp, ignore_errors=True))
    monkeypatch.setattr(tempfile, "tempdir", own_tmp)
    monkeypatch.setenv("TMPDIR", own_tmp)
    spec.write_text(SPEC.read_text().replace("pp = 2", "pp = 1").replace("dp = 2", "dp = 1")
                    .replace('"clusters/', f'"{SPEC.parent}/clusters/'))
    first = subprocess.Popen([sys.executable, "-m", "geotrain", "train", str(spec), "--steps", "5000", "--out",
                              str(run), "--wan", "off", "--no-progress", "--serve-prefill", "0",
                              "--checkpoint-every", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (_procs_of(first.pid) and len(_private(first.pid)) >= 2):
            assert first.poll() is None, "the first run ended early"
            time.sleep(0.1)                    # (its ranks have started: its secret and socket are in place)
        held = _private(first.pid)
        assert {p.name.split("-")[1] for p in held} >= {"run", "bt"}, held      # the run's secret, the service's
        assert any(p.name == "work.sock" for d in held for p in d.iterdir()), held
        # A second run into the same directory: refused in one line, naming the first.
        rc, _, err = geotrain(capfd, "train", spec, "--steps", "1", "--out", run, "--wan", "off", "--no-progress")
        lines = [x for x in err.splitlines() if x.strip()]
        assert rc == 2 and len(lines) == 1 and f"in use by another run (pid {first.pid} on" in lines[0], err
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    deadline = time.monotonic() + 30
    while _procs_of(first.pid) and time.monotonic() < deadline:      # its ranks die with it (PDEATHSIG)
        time.sleep(0.1)
    assert not _procs_of(first.pid)
    assert _private(first.pid) == held                                # kill -9: nothing could remove them
    # The next start (into the same directory) takes the dead run's lock over and sweeps its folders.
    rc, out, err = geotrain(capfd, "train", spec, "--steps", "1", "--out", run, "--wan", "off", "--no-progress",
                            "--checkpoint-every", "0")
    assert rc == 0, err
    assert f"took over the lock of a run that is no longer running (pid {first.pid} on" in out + err
    assert _private(first.pid) == [] and not (run / "logs" / "run_secret").exists()
