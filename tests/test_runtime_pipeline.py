"""A pp=2 x dp=2 run trains exactly like one process training the whole model on the same batches.

One launch of 4 local ranks runs many cases back to back (process start-up is paid once); each
case's per-step losses must match a single-process reference (fp32, relative 1e-5). The same
launch also runs an fp16 case with an injected overflow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cases import case
from _reference import reference_run, single_process_losses

from geotrain.layout.plan import StagePlan
from geotrain.planner.manual import plan_from_job, split_even
from geotrain.runtime.train_config import RunCase
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
STEPS = 5
# Every schedule kind and sharding in one 4-rank launch: the runtime subset scripts/test.sh also runs on the
# oldest supported torch (2.11: FSDP2's private state changed shape since).
pytestmark = pytest.mark.oldest_torch

# (name, plan overrides, virtual stages per physical stage)
CASES = [
    ("gpipe-none-replicate", {"schedule": "gpipe", "checkpointing": "none", "sharding": "replicate"}, 1),
    ("gpipe-full-zero3", {"schedule": "gpipe", "checkpointing": "full", "sharding": "zero3"}, 1),
    ("1f1b-none-zero3", {"schedule": "1f1b", "checkpointing": "none", "sharding": "zero3"}, 1),
    ("1f1b-full-replicate", {"schedule": "1f1b", "checkpointing": "full", "sharding": "replicate"}, 1),
    ("1f1b-selective-zero1", {"schedule": "1f1b", "checkpointing": "selective", "sharding": "zero1"}, 1),
    ("wan1f1b-none-zero2", {"schedule": "wan-1f1b", "checkpointing": "none", "sharding": "zero2",
                            "extra_warmup": (1, 0)}, 1),
    ("wan1f1b-full-replicate", {"schedule": "wan-1f1b", "checkpointing": "full", "sharding": "replicate",
                                "extra_warmup": (2, 0)}, 1),
    ("zbh1-none-replicate", {"schedule": "zb-h1", "checkpointing": "none", "sharding": "replicate"}, 1),
    ("interleaved-full-replicate", {"schedule": "interleaved", "checkpointing": "full", "sharding": "replicate"}, 2),
    # Four stages over two DCs: the gradient norm's sums pass down a chain of three boundaries and back.
    ("pp4-1f1b-replicate", {"schedule": "1f1b", "sharding": "replicate", "dp": 1, "num_microbatches": 8,
                            "pipeline_offsets": (), "stages": tuple(StagePlan(dc, (r,)) for dc, r in zip(
                                ("east", "east", "west", "west"), split_even(6, 4)))}, 1),
]


def recipe_spec(tmp: Path, clip: float = 0.4) -> Path:
    """tiny_2dc with a recipe that acts in 5 steps: warm-up, cosine decay, weight decay, clipping
    below the tiny model's gradient norms (~0.5)."""
    text = SPEC.read_text().replace('cluster = "clusters/', f'cluster = "{SPEC.parent}/clusters/')
    text = text.replace("[job]\n", f"[job]\nwarmup_steps = 2\ngrad_clip = {clip}\nweight_decay = 0.1\n"
                                    "eval_every = 5\neval_batches = 1\n")
    path = tmp / "tiny_2dc_recipe.toml"
    path.write_text(text)
    return path


def reference(spec: Path, steps: int, dp: int = 2, m: int = 4):
    plan = plan_from_job(load_spec(spec))
    return reference_run(spec, plan.micro_batch, m, dp, steps)


def reference_losses(steps: int) -> list[float]:
    plan = plan_from_job(load_spec(SPEC))
    return single_process_losses(SPEC, plan.micro_batch, plan.num_microbatches, plan.dp, steps)


def read_losses(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines() if line.strip()]


def _case_config(tmp: Path, spec_path: Path, name: str, overrides: dict, vps: int) -> RunCase:
    spec = load_spec(spec_path)
    plan = plan_from_job(spec, virtual_per_stage=vps).with_(precision="fp32", **overrides)
    return case(spec_path, out=str(tmp / name), plan=plan, steps=STEPS, data="synthetic",
                     progress=False, checkpoint_every=0)


def pipeline_cases(tmp: Path) -> list[RunCase]:
    """CASES and the fp16 case: 4 ranks each (conftest's `pipeline_launch` runs them)."""
    cases = [_case_config(tmp, recipe_spec(tmp), n, o, v) for n, o, v in CASES]
    fp16 = case(SPEC, out=str(tmp / "fp16"), steps=6, data="synthetic", progress=False,
                     checkpoint_every=0, overrides={"precision": "fp16", "sharding": "zero3"},
                     inject_inf=[[3, 3]])
    assert plan_from_job(load_spec(SPEC)).num_ranks == 4
    return cases + [fp16]


@pytest.fixture(scope="module")
def launched(pipeline_launch) -> Path:
    return pipeline_launch


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_pipeline_matches_single_process(launched: Path, name: str) -> None:
    """Losses, the global gradient norm the run clipped with (pp2 x dp2, every sharding: the sum
    over both stages, across the WAN) and the held-out loss equal the single process's under
    warm-up, cosine decay, weight decay and clipping that acts (norms ~0.5 > 0.4)."""
    rows = read_losses(launched / name)
    got, norms = [x["loss"] for x in rows], [x["grad_norm"] for x in rows]
    plan = json.loads((launched / name / "plan.json").read_text())["plan"]
    want, want_norms, want_eval = reference(launched / "tiny_2dc_recipe.toml", STEPS, plan["dp"],
                                            plan["num_microbatches"])
    assert len(got) == STEPS
    assert all(n > 0.4 for n in want_norms[:3])                    # the clipping acted
    for g, w in zip(got + norms, want + want_norms):
        assert abs(g - w) <= 1e-5 * abs(w), (name, got, want, norms, want_norms)
    assert [x["lr"] for x in rows[:2]] == [5e-4, 1e-3]          # warm-up over 2 steps
    # The held-out loss through the pipeline, forward only, at step 5 (eval_every = 5)
    assert [x["step"] for x in rows if "eval_loss" in x] == [5] and list(want_eval) == [5]
    assert abs(rows[4]["eval_loss"] - want_eval[5]) <= 1e-5 * want_eval[5], (name, rows[4], want_eval)
    # The model learned something, so equal losses are not equal by accident of a frozen model.
    assert got[-1] < got[0]


@pytest.mark.slow
def test_measured_trace_has_every_kind(launched: Path) -> None:
    from geotrain.trace.schema import Trace

    trace = Trace.read_jsonl(launched / "zbh1-none-replicate" / "measured_trace.jsonl")
    kinds = {e.kind for e in trace.events}
    assert {"forward", "backward_input", "backward_weight", "recv_wait", "allreduce", "optimizer"} <= kinds
    assert trace.num_ranks == 4 and {e.rank for e in trace.events} == {0, 1, 2, 3}
    fwd = [e for e in trace.events if e.kind == "forward" and e.iteration == 1]
    assert len(fwd) == 4 * 4  # 4 ranks x 4 micro-batches
    assert all(0 <= e.start <= e.end for e in trace.events)
    # Stage 1 cannot start micro-batch 0 before stage 0 finished it (common time axis).
    f0 = min(e.end for e in fwd if e.rank == 0 and e.mb == 0)
    f1 = min(e.start for e in fwd if e.rank == 2 and e.mb == 0)
    assert f1 >= f0


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_on_every_rank(launched: Path) -> None:
    losses = read_losses(launched / "fp16")
    skipped = [x["step"] for x in losses if x["skipped"]]
    assert 3 in skipped
    step3 = next(x for x in losses if x["step"] == 3)
    before = next(x for x in losses if x["step"] == 2)
    assert step3["loss_scale"] == before["loss_scale"] / 2  # backed off once
    summary = json.loads((launched / "fp16" / "summary.json").read_text())
    # Every rank of every stage took the same number of optimizer steps: the skip was global.
    per_rank = summary["optimizer_steps_per_rank"]
    assert per_rank == [6 - len(skipped)] * 4
    assert all(torch.isfinite(torch.tensor(x["loss"])) for x in losses)
    assert losses[-1]["loss"] < losses[0]["loss"]


@pytest.mark.slow
def test_boundary_tensors_cross_the_wan_in_the_training_dtype(launched: Path) -> None:
    """What the planner and simulator count per transfer is what crosses: fp16 here, half of fp32."""
    from geotrain.costs import CostModel
    from geotrain.trace.schema import Trace

    spec = load_spec(SPEC)
    plan = plan_from_job(spec)
    xfers = [e for e in Trace.read_jsonl(launched / "fp16" / "measured_trace.jsonl").events if e.kind == "transfer"]
    assert xfers
    want = CostModel(spec.model, precision="fp16").boundary_bytes(plan.micro_batch)
    assert {e.bytes for e in xfers} == {want}
    assert want == plan.micro_batch * spec.model.seq_len * spec.model.hidden * 2
