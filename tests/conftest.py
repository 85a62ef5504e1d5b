import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    """Tokenized data goes to a folder of the session (ranks inherit it), never to ~/.cache."""
    if "GEOTRAIN_CACHE_DIR" not in os.environ:
        os.environ["GEOTRAIN_CACHE_DIR"] = str(tmp_path_factory.mktemp("token_cache"))


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES


@pytest.fixture(scope="session")
def tiny_2dc_builtin_run(tmp_path_factory) -> Path:
    """`geotrain train examples/tiny_2dc.toml` with the built-in launcher, 3 steps, synthetic data,
    plain gloo (`--wan off`: the losses are the same over any WAN) -- the reference the torchrun and
    rehearse tests compare with, paid once per session."""
    from _cli import geotrain

    out = tmp_path_factory.mktemp("builtin") / "run"
    # In this process: the CLI's start-up imports are paid already (the ranks are processes).
    rc, _, err = geotrain(None, "train", EXAMPLES / "tiny_2dc.toml", "--steps", "3", "--wan", "off", "--out", out,
                          "--no-progress", "--data", "synthetic", env={"OMP_NUM_THREADS": "1"})
    assert rc == 0, err[-3000:]
    return out


@pytest.fixture(scope="session")
def collective_counts(tmp_path_factory):
    """test_runtime_bytes' and test_runtime_world_sync's cases in one 4-rank launch of the counting
    worker (`_collective_ranks`): (run dir, {"bytes": per rank [counts], "sync": ...})."""
    from _collective_ranks import counted_cases
    from test_runtime_bytes import bytes_cases
    from test_runtime_world_sync import sync_cases

    tmp = tmp_path_factory.mktemp("collectives")
    return tmp, counted_cases(tmp, {"bytes": bytes_cases(tmp), "sync": sync_cases(tmp)}, timeout=420)


def _runtime_cases(stem: str, tmp: Path) -> list:
    """The 4-rank cases test file `stem` hands pipeline_launch (imported only when that file runs)."""
    if stem == "test_runtime_pipeline":
        from test_runtime_pipeline import pipeline_cases
        return pipeline_cases(tmp)
    if stem == "test_runtime_tp":
        from test_runtime_tp import tp_cases
        return tp_cases(tmp / "tp")
    if stem == "test_runtime_moe":
        from test_runtime_moe import moe_cases
        return moe_cases(tmp / "moe")
    if stem == "test_reshard_resume":
        from test_reshard_resume import reshard_cases
        return reshard_cases(tmp / "reshard")
    from test_runtime_wan import reference_case
    return [reference_case(tmp / "wan-ref")]


@pytest.fixture(scope="session")
def pipeline_launch(request, tmp_path_factory) -> Path:
    """The cases of test_runtime_pipeline, test_runtime_tp (in tp/), test_runtime_moe (in moe/), the 4-rank
    part of test_reshard_resume (in reshard/) and test_runtime_wan's plain-gloo reference (in wan-ref/) in one
    4-rank launch -- of the files this session runs tests of (the oldest-torch leg runs only
    test_runtime_pipeline's): a launch's start-up (four ranks importing torch) is most of a small case's time."""
    from geotrain.runtime.launch import launch

    tmp = tmp_path_factory.mktemp("runtime")
    running = {Path(str(item.fspath)).stem for item in request.session.items}
    cases = [c for stem in ("test_runtime_pipeline", "test_runtime_tp", "test_runtime_moe",
                          "test_reshard_resume", "test_runtime_wan")
             if stem in running for c in _runtime_cases(stem, tmp)]
    launch(cases, 4, tmp / "launch", timeout_s=280)
    return tmp
