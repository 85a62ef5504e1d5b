"""Checkpoints never destroy work: a fresh run into a used directory starts a new series (the old
one is kept), a save never leaves a moment without the checkpoint `latest` names, `--resume`
without a usable checkpoint is a one-line error that leaves losses.jsonl alone, and the rank that
was killed -9 is the one the launcher names."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from _cases import case

from geotrain.errors import GeotrainError
from geotrain.layout.plan import LinkPlan
from geotrain.planner.manual import plan_from_job
from geotrain.runtime import checkpoint as ck
from geotrain.runtime import runfile
from geotrain.runtime.launch import launch
from geotrain.runtime.train_config import RunCase
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"


# ------------------------------------------------------------------------------ file operations only
class _NoDist:
    """Checkpointer.save's collective calls on one process: DCP writes a .metadata and nothing else."""

    @staticmethod
    def install(monkeypatch):
        monkeypatch.setattr(ck.dist, "get_rank", lambda: 0)
        monkeypatch.setattr(ck.dist, "barrier", lambda: None)
        monkeypatch.setattr(ck.dcp, "save", lambda state, checkpoint_id: (Path(checkpoint_id) / ".metadata")
                            .write_text("m"))
        monkeypatch.setattr(ck.Checkpointer, "_state", lambda self, step: {})


def _pointed(root: Path) -> bool:
    p = root / "latest"
    return not p.exists() or (root / p.read_text().strip() / ".metadata").is_file()


def _watch_invariant(monkeypatch, root: Path) -> list[str]:
    """Before and after every rename/replace/rmtree: `latest` names a complete checkpoint."""
    broken: list[str] = []
    for mod, name in ((ck.os, "rename"), (ck.os, "replace"), (ck.shutil, "rmtree")):
        real = getattr(mod, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            out = _real(*a, **kw)
            if not _pointed(root):
                broken.append(f"after {_name}{tuple(str(x) for x in a)}")
            return out
        monkeypatch.setattr(mod, name, wrapped)
    return broken


def _make(root: Path, step: int) -> None:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("old")


def test_saving_never_leaves_latest_without_its_checkpoint(monkeypatch, tmp_path):
    root = tmp_path / "checkpoints"
    _make(root, 35)
    _make(root, 40)
    (root / "latest").write_text("step_00000040\n")
    _NoDist.install(monkeypatch)
    broken = _watch_invariant(monkeypatch, root)
    c = ck.Checkpointer(root, 0, 0, {}, None, None)
    c.save(40)                                  # the same step again (a resumed run redoing it)
    c.save(10)                                  # a lower step than what the directory holds
    assert broken == []
    assert (root / (root / "latest").read_text().strip() / ".metadata").read_text() == "m"


def test_pruning_keeps_the_highest_steps_of_the_series_and_the_latest(tmp_path):
    root = tmp_path / "c"
    for s in (2, 4, 6, 8):
        _make(root, s)
    (root / "latest").write_text("step_00000004\n")
    runfile.prune(root, keep=2)
    assert sorted(p.name for _, p in runfile.step_dirs(root)) == ["step_00000004", "step_00000006", "step_00000008"]


def test_resume_point_names_what_is_missing(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(GeotrainError, match="no complete checkpoint.*does not exist"):
        runfile.resume_point(root)
    root.mkdir()
    with pytest.raises(GeotrainError, match="latest is missing"):
        runfile.resume_point(root)
    (root / "latest").write_text("step_00000002\n")
    with pytest.raises(GeotrainError, match="'step_00000002', which is not a directory"):
        runfile.resume_point(root)
    (root / "step_00000002").mkdir()
    with pytest.raises(GeotrainError, match="incomplete"):
        runfile.resume_point(root)
    # the one `latest` names broken, an older one complete: that one, and why latest was passed over
    _make(root, 1)
    (root / "step_00000001" / "__0_0.distcp").write_bytes(b"x")
    assert runfile.resume_points(root) == ([root / "step_00000001"], "step_00000002 is incomplete (its .metadata is "
                                                                "missing)")


# ------------------------------------------------------------------------------ real runs (2 ranks)
def _plan():
    base = plan_from_job(load_spec(SPEC)).with_(precision="fp32", sharding="replicate")
    links = tuple(LinkPlan(src_dc=lp.src_dc, dst_dc=lp.dst_dc) for lp in base.links)
    return base.with_(dp=1, links=links, pipeline_offsets=())


def _cfg(out: Path, steps: int, every: int, **kw) -> RunCase:
    return case(SPEC, out=str(out), plan=_plan(), steps=steps, data="synthetic",
                     progress=False, checkpoint_every=every, **kw)


def _losses(run: Path) -> dict[int, float]:
    return {d["step"]: d["loss"] for d in map(json.loads, (run / "losses.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_reused_directory_starts_a_new_series_and_bad_resumes_are_one_line_errors(tmp_path, capfd):
    run = tmp_path / "run"
    # An earlier, longer run, then a fresh short run into the same directory, then the short run
    # resumed: it continues from its own step 2 (one launch: its cases run one after another).
    launch([_cfg(run, 6, 2), _cfg(run, 2, 1), _cfg(run, 3, 1, resume=True)], 2, tmp_path / "l1", timeout_s=180)
    said = capfd.readouterr().out + (tmp_path / "l1" / "logs" / "rank0.log").read_text()
    assert "kept as checkpoints.run1/" in said or (run / "checkpoints.run1").is_dir()
    assert (run / "checkpoints.run1" / "latest").read_text().strip() == "step_00000006"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert max(p.name for p in (run / "checkpoints").glob("step_*")) == "step_00000003"   # none of the long run
    assert sorted(_losses(run)) == [1, 2, 3]
    before = _losses(run)
    # The latest checkpoint broken after its save (issue #30: its .metadata deleted): --resume takes
    # the one before it, says so on the console, and the curve continues as it was.
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_00000003"
    (latest / ".metadata").unlink()
    capfd.readouterr()
    launch([_cfg(run, 4, 1, resume=True)], 2, tmp_path / "l3", timeout_s=180)
    said = capfd.readouterr().out
    assert ("--resume: step_00000003 is incomplete (its .metadata is missing); resuming from step_00000002, "
            "the newest complete checkpoint") in said, said
    after = _losses(run)
    assert sorted(after) == [1, 2, 3, 4] and all(after[s] == before[s] for s in (1, 2, 3))
    # None complete at all: one line naming what is missing; the losses stay as they were.
    for d in (run / "checkpoints").glob("step_*"):
        (d / ".metadata").unlink(missing_ok=True)
    kept = (run / "losses.jsonl").read_text()
    with pytest.raises(GeotrainError) as e:
        launch([_cfg(run, 5, 1, resume=True)], 2, tmp_path / "l4", timeout_s=180)
    assert "no complete checkpoint" in str(e.value) and "\n" not in str(e.value)
    assert (run / "losses.jsonl").read_text() == kept


def test_resume_falls_back_past_a_checkpoint_that_cannot_be_loaded(monkeypatch, tmp_path, capfd):
    """A checkpoint whose files are there but do not load (garbage .metadata, a torn shard): the
    one before it, and the note says why."""
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        _make(root, step)
        (root / f"step_{step:08d}" / "__0_0.distcp").write_bytes(b"x")
    (root / "latest").write_text("step_00000004\n")
    monkeypatch.setattr(ck.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(ck.Checkpointer, "_check_shared", lambda self: None)
    tried = []

    def load(self, path):
        tried.append(path.name)
        if path.name == "step_00000004":
            raise ValueError("unpickling stack underflow")
        return 2, None
    monkeypatch.setattr(ck.Checkpointer, "load", load)
    c = ck.Checkpointer(root, 0, 0, {}, None, None)
    assert c.begin(resume=True, saving=True) == (2, None) and tried == ["step_00000004", "step_00000002"]
    assert c.notes == ["geotrain train: --resume: step_00000004 cannot be loaded (ValueError: unpickling stack "
                       "underflow); resuming from step_00000002, the newest complete checkpoint"]


def _rank_pid(err_dir: Path, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"GEOTRAIN_ERROR_DIR={err_dir}".encode() in env and f"RANK={rank}".encode() in env:
                return int(proc.name)
    return None


@pytest.mark.slow
def test_the_rank_killed_minus_9_is_the_one_named(tmp_path):
    run = tmp_path / "run"
    cfg = case(SPEC, out=str(run), steps=400, data="synthetic", progress=False,
                    checkpoint_every=0, overrides={"precision": "fp32", "sharding": "replicate"})

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline:
            losses = run / "losses.jsonl"
            if losses.exists() and losses.read_text().strip():
                pid = _rank_pid(tmp_path / "l" / "logs" / "errors", 2)
                if pid:
                    os.kill(pid, signal.SIGKILL)
                    return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    with pytest.raises(GeotrainError) as e:
        launch([cfg], 4, tmp_path / "l", timeout_s=180)
    t.join()
    assert str(e.value).startswith("rank 2 ") and "signal 9" in str(e.value), str(e.value)
