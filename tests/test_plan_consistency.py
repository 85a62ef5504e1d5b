"""Consistency (#27 item 4): a spec `validate` and `plan` accept is one `simulate`, `train` and
`rehearse` accept; a spec they refuse, train and rehearse refuse too, in one line.

Over every example, the specs that pin a tensor-parallel degree against odd model widths (the
issue's case: tp = 4 with ffn = 2731 was validated and planned, then refused by simulate), a
few cross-DC / schedule / sharding variants and a seeded part of the mutated-spec fuzz corpus
(test_spec_fuzz.specs): validate -> plan --out -> the plan file through `check_plan_for_spec`,
`simulate`, and `train` and `rehearse` up to the moment they would start a process (the CLI
in-process with the process starter replaced: every check either makes before a rank, a
namespace or a host starts, at the plan's full size). Then the plan is shrunk
(tests/_tiny_plan.py: same layout choices at a few CPU ranks) and that plan is accepted too; a
fixed sample of the tiny plans trains for real (train's pre-launch path, then its launcher's
ranks, 1 step) and one is rehearsed (`geotrain rehearse`, root; CI runs as root: never skipped).
Planted, each fails it: train refusing a schedule plan picks, a rank refusing tp = 2 at model
build (only the real launch sees that one), train rewording a refusal.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import sys
from pathlib import Path

import pytest
from _tiny_plan import shrink

from geotrain.cli import main
from geotrain.layout.plan import load_plan
from geotrain.layout.plan_check import plan_spec_problem
from geotrain.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.toml"))


class _WouldStart(BaseException):
    """Raised where train or rehearse would start its first process: everything before it accepted."""


def _would_start(*_a, **_k):
    raise _WouldStart


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    """train and rehearse run in-process up to their first process: the rank launcher, the DiLoCo
    workers' store, the rehearsal's namespaces. A full-size plan's thousands of ranks pass the
    local-process limit (a machine's, not the plan's: GEOTRAIN_MAX_LOCAL_RANKS)."""
    from geotrain.orchestrate import rehearse_run
    from geotrain.runtime import diloco_launch, launch

    monkeypatch.setattr(launch, "launch_ranks", _would_start)
    monkeypatch.setattr(diloco_launch, "_start_store", _would_start)
    monkeypatch.setattr(rehearse_run, "run_rehearsal", _would_start)
    monkeypatch.setenv("GEOTRAIN_MAX_LOCAL_RANKS", str(10**8))


def _cli(argv: list[str], until_start: bool = False) -> tuple[int, str]:
    """(exit status, stderr) of the CLI in-process. until_start (train, rehearse): 0 when it reached
    its first process; a command that returned instead ran past the stubs (-1: fix the fixture)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
            if until_start and rc == 0:
                rc = -1
                print("returned without reaching a stubbed process start", file=sys.stderr)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
        except _WouldStart:
            rc = 0
    return rc, err.getvalue().strip()


_PLANNED: dict[str, str] = {}     # spec text -> the plan file `plan` made of it (reused by the launched sample)


def _later_commands(source: Path, tmp: Path) -> list[tuple[str, int, str]]:
    """(command, exit status, stderr) of train and rehearse on `source` (up to their first process)."""
    out = tmp / f"{source.stem}.runs"
    return [("train", *_cli(["train", str(source), "--steps", "1", "--wan", "shaper", "--no-progress",
                             "--out", str(out / "train")], until_start=True)),
            ("rehearse", *_cli(["rehearse", str(source), "--steps", "1", "--no-compare", "--out", str(out / "rh")],
                               until_start=True))]


def _reason(err: str, spec_path: Path) -> str:
    """A command's one-line refusal without the command's and the file's name (the same reason from each)."""
    return re.sub(r"^geotrain \w+: error: ", "", err).replace(f"{spec_path}: ", "").replace(str(spec_path), "SPEC")


def _consistent(spec_path: Path, tmp: Path, simulate: bool = True) -> str | None:
    """None, or what broke the chain: validate and plan accept, a later command refuses (at full
    size or shrunk); or they refuse and train or rehearse does not, or not in one line with the same reason."""
    rc, err = _cli(["validate", str(spec_path)])
    if rc == 0:
        out = tmp / f"{spec_path.stem}.plan.json"
        rc, err = _cli(["plan", str(spec_path), "--out", str(out), "--top-k", "1"])
        if rc == 0:
            _PLANNED[spec_path.read_text()] = out.read_text()
    if rc != 0:
        for cmd, rc2, err2 in _later_commands(spec_path, tmp):
            if rc2 == 0 or err2.count("\n") or _reason(err2, spec_path) != _reason(err, spec_path):
                return f"{spec_path.name}: validate/plan refuse ({err}); {cmd} says rc={rc2}: {err2[-300:]!r}"
        return None
    problem = plan_spec_problem(load_spec(spec_path), load_plan(out)[0])
    if problem:
        return f"{spec_path.name}: validate and plan accept it; simulate/train/rehearse refuse: {problem}"
    if simulate:
        rc, err = _cli(["simulate", str(out), "--out", str(tmp / f"{spec_path.stem}.sim"), "--iterations", "1",
                        "--no-compare", "--no-timeline"])     # (the plan itself: not its alternatives, not a PNG)
        if rc != 0:
            return f"{spec_path.name}: validate and plan accept it; simulate refuses: {err}"
    tiny = tmp / f"{spec_path.stem}.tiny.json"
    tiny.write_text(json.dumps(shrink(json.loads(out.read_text()))))
    for source in (out, tiny):
        for cmd, rc, err in _later_commands(source, tmp):
            if rc != 0:
                return f"{spec_path.name}: validate and plan accept it; {cmd} refuses {source.name}: {err}"
    return None


def _variant(tmp: Path, example: str, **job) -> Path:
    """`example` with [job] keys replaced (a table as a dotted key), its cluster and model files absolute."""
    text = (ROOT / "examples" / example).read_text()
    text = text.replace('"clusters/', f'"{ROOT}/examples/clusters/').replace('"models/', f'"{ROOT}/examples/models/')
    head, _, rest = text.partition("[job]\n")
    keep = [ln for ln in rest.splitlines() if ln.split("=")[0].strip() not in job]
    pins = [f"{k} = {json.dumps(v)}" for k, v in job.items() if v is not None]
    path = tmp / f"{Path(example).stem}-{len(list(tmp.glob('*-v*.toml')))}-v.toml"
    path.write_text(head + "[job]\n" + "\n".join(pins + keep) + "\n")
    return path


# What the examples leave out: DiLoCo (streaming too), a pinned tp, zero1, compressed boundaries, every schedule.
VARIANTS = [("tiny_2dc.toml", {"cross_dc": "diloco", "pp": None, "diloco.fragments": 2, "diloco.inner_steps": 4}),
            ("tiny_2dc.toml", {"boundary_compression": "int8", "schedule": "gpipe", "sharding": "zero1"}),
            ("llama1b_a100_3dc.toml", {"tp": 2}),
            ("llama1b_a100_3dc.toml", {"schedule": "interleaved", "precision": "fp16", "checkpointing": "selective"}),
            ("mixtral_8x7b_h100_3dc.toml", {"schedule": "zb-h1", "checkpointing": "full", "precision": "fp32"})]


@pytest.mark.parametrize("example, job", VARIANTS, ids=[f"{e}-{i}" for i, (e, _) in enumerate(VARIANTS)])
def test_variants_are_accepted_by_every_command(example, job, tmp_path):
    spec = _variant(tmp_path, example, **job)
    assert _consistent(spec, tmp_path, simulate=False) is None
    assert (tmp_path / f"{spec.stem}.plan.json").is_file(), _cli(["plan", str(spec)])[1]    # planned, not refused


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_are_accepted_by_every_command(example, tmp_path):
    assert _consistent(_variant(tmp_path, example), tmp_path, simulate=example.startswith("tiny")) is None


@pytest.mark.parametrize("tp, ffn, heads", [(4, 2731, 16), (2, 1023, 16), (4, 4096, 6), (8, 2048, 4), (2, 512, 8)])
def test_a_pinned_tp_against_odd_widths(tp, ffn, heads, tmp_path):
    """Refused by validate (and so by plan) when tp does not divide a width it splits; else the
    plan it makes runs. Fails on the old code for (4, 2731, 16): validate ok, plan ok, simulate no."""
    (tmp_path / "m.toml").write_text(f'name = "odd"\nlayers = 4\nhidden = {heads * 32}\nheads = {heads}\n'
                                     f'kv_heads = {heads}\nffn = {ffn}\nvocab = 512\nseq_len = 64\n')
    spec = tmp_path / "s.toml"
    spec.write_text(f'name = "odd-tp"\ncluster = "{ROOT}/examples/clusters/a100_5zone.toml"\nmodel = "m.toml"\n'
                    f'[job]\nglobal_batch = 64\ntp = {tp}\n')
    assert _consistent(spec, tmp_path) is None
    divides = ffn % tp == 0 and heads % tp == 0
    assert (_cli(["validate", str(spec)])[0] == 0) == divides


def test_the_fuzz_corpus_is_consistent(tmp_path):
    """A seeded fifth of the fuzz corpus's first 200 specs (each accepted one planned and checked;
    simulated for one in four)."""
    from test_spec_fuzz import specs

    pick = random.Random(27)
    bad = []
    for i, path, what in specs(tmp_path):
        if i >= 200:
            break
        if pick.random() < 0.2:
            problem = _consistent(path, tmp_path, simulate=pick.random() < 0.25)
            if problem:
                bad.append(f"{problem} ({what})")
    assert not bad, "\n".join(bad[:10])


@pytest.mark.parametrize("ep", ["auto", 8])
def test_a_moe_job_pinning_zero1(ep, tmp_path):
    """ZeRO-1 does not run with expert parallelism (layout.tp_check.ep_problem): a MoE job pinning
    sharding zero1 is planned at ep = 1, or refused by validate when it pins ep > 1. Failed before:
    validate and plan accepted mixtral with zero1 at ep = 8, which simulate and train refused."""
    text = (ROOT / "examples" / "mixtral_8x7b_h100_3dc.toml").read_text()
    pin = '"auto"' if ep == "auto" else ep
    text = text.replace("[job]\n", f'[job]\nsharding = "zero1"\nep = {pin}\n')
    text = text.replace('"clusters/', f'"{ROOT}/examples/clusters/').replace('"models/', f'"{ROOT}/examples/models/')
    spec = tmp_path / "moe.toml"
    spec.write_text(text)
    assert _consistent(spec, tmp_path, simulate=False) is None
    rc, err = _cli(["validate", str(spec)])
    assert (rc, err.count("\n")) == ((0, 0) if ep == "auto" else (2, 0)), err
    assert ep == "auto" or "sharding zero1 does not run with ep=8" in err


def _tiny_plan_file(tmp: Path, example: str, **job) -> Path:
    """The planner's plan for `example` (with `job` changes), shrunk (tests/_tiny_plan.py)."""
    spec = _variant(tmp, example, **job)
    full = tmp / f"{spec.stem}.plan.json"
    if spec.read_text() in _PLANNED:         # planned by the tests above (plan is deterministic)
        full.write_text(_PLANNED[spec.read_text()])
    else:
        rc, err = _cli(["plan", str(spec), "--out", str(full), "--top-k", "1"])
        assert rc == 0, err
    tiny = tmp / f"{spec.stem}.tiny.json"
    tiny.write_text(json.dumps(shrink(json.loads(full.read_text()))))
    return tiny


# Trained for real at their tiny size, one launch of 4 CPU ranks running each in turn: expert
# parallelism (ep 2, MoE family), the interleaved schedule (2 chunks a stage), tensor parallelism.
LAUNCHED = [("mixtral_8x7b_h100_3dc.toml", {"ep": 8}), ("llama2_7b_8k_h100_3dc.toml", {"schedule": "interleaved"}),
            ("llama1b_a100_3dc.toml", {"tp": 2})]


def test_a_sample_of_tiny_plans_trains(tmp_path, monkeypatch):
    """`geotrain train`'s pre-launch path (load_case, as the CLI runs it above) and its launcher's
    ranks (runtime.launch: the worker runs the cases in turn) train one step of each."""
    from geotrain.orchestrate.training_run import load_case
    from geotrain.runtime.launch import launch
    from geotrain.runtime.train_config import TrainConfig, WanConfig

    monkeypatch.undo()                   # real processes from here
    cases = [load_case(_tiny_plan_file(tmp_path, ex, **job), TrainConfig(
        out=str(tmp_path / f"run{i}"), steps=1, progress=False, wan=WanConfig(mode="off")))
        for i, (ex, job) in enumerate(LAUNCHED)]
    assert [(c.plan.ep, c.plan.virtual_per_stage, c.plan.tp) for c in cases] == [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    assert {c.plan.num_ranks for c in cases} == {4}
    launch(cases, 4, tmp_path / "launch", rank0_stdout=False, timeout_s=600)
    for c in cases:
        losses = [json.loads(x)["loss"] for x in (Path(c.config.out) / "losses.jsonl").read_text().splitlines()]
        assert len(losses) == 1 and 0 < losses[0] < 20, (c.spec.name, losses)


@pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                    reason="network namespaces need root (CI runs as root: never skipped there)")
def test_a_tiny_diloco_plan_is_rehearsed(tmp_path, monkeypatch):
    """Rehearsed for real: two DiLoCo workers, one DC each (each worker its own torchrun job of one
    host, the workers' store in the first DC), an outer exchange every step. rehearse refused both
    before: a plan whose every job is in one DC ("no WAN to rehearse"), and DiLoCo (no --diloco-worker)."""
    monkeypatch.undo()
    example, job = VARIANTS[0]
    tiny = _tiny_plan_file(tmp_path, example, **job)
    plan = load_plan(tiny)[0]
    assert (plan.num_workers, plan.outer.inner_steps, len(plan.worker_dcs())) == (2, 2, 2)
    rc, err = _cli(["rehearse", str(tiny), "--steps", "2", "--no-compare", "--no-progress",
                    "--out", str(tmp_path / "rh")])
    assert rc == 0, err
    for run in (tmp_path / "rh", tmp_path / "rh" / "worker1"):
        assert len((run / "losses.jsonl").read_text().splitlines()) == 2
