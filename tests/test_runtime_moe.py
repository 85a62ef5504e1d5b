"""A mixture-of-experts model trains across two emulated DCs with expert parallelism exactly like
one process, resumes from its DCP checkpoint onto another layout, and exports back to transformers.

The cases run back to back in the 4-rank launch test_runtime_pipeline's share (conftest's
`pipeline_launch`): pp=2 x dp=2 with ep=2 (each stage's two
replicas, inside its DC, split the experts; tokens travel with all_to_all_single), replicated and
under FSDP2 (zero3), a zero-bubble split backward, ep=2 composed with tp=2 (each expert's rows
split too) under full checkpointing; and two steps of the first layout resumed from their DCP
checkpoint onto pp=1 x dp=2 x tp=2 x ep=2 under zero3. Every step's loss and global gradient norm must equal the
single-process reference (`_reference.reference_run`: the same micro-batches, the load-balancing
loss per micro-batch) within 1e-5 -- the gradient norm moves by 3e-4 without the aux loss, so it
is checked too. The first case's checkpoint then exports as a MixtralForCausalLM that transformers
reloads (warnings as errors) with geotrain's logits.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from _cases import case
from _reference import reference_run

from geotrain.layout.plan import Plan, StagePlan

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
MB = 2


def moe_spec(tmp: Path) -> Path:
    """tiny-moe on tiny_2dc's two emulated DCs, with 4 "GPUs" in each (pp=1 x dp=2 x tp=2 fits one)."""
    cluster = (ROOT / "examples/clusters/tiny_2dc.toml").read_text().replace("gpus = 2\n", "gpus = 4\n")
    (tmp / "cluster.toml").write_text(cluster)
    path = tmp / "tiny_moe_2dc.toml"
    path.write_text(f'name = "tiny-moe-2dc"\ncluster = "{tmp / "cluster.toml"}"\n'
                    'model = "tiny-moe"\n[job]\nglobal_batch = 16\nmicro_batch = 2\nprecision = "fp32"\n'
                    'pp = 2\ndp = 2\nsteps = 4\nlr = 3e-3\ngrad_clip = 1.0\n')
    return path


def _plan(pp: int, dp: int, tp: int, sharding: str, m: int, **kw) -> Plan:
    ranges = [(0, 3), (3, 6)] if pp == 2 else [(0, 6)]
    stages = tuple(StagePlan(dc=("east", "west")[s], chunks=(ranges[s],)) for s in range(pp))
    return Plan(stages=stages, dp=dp, tp=tp, ep=2, micro_batch=MB, num_microbatches=m, precision="fp32",
                sharding=sharding, name=f"moe-pp{pp}-dp{dp}-tp{tp}-{sharding}", **kw)


CASES = {
    "pp2-dp2-ep2": _plan(2, 2, 1, "replicate", 4),
    "pp2-dp2-ep2-zero3": _plan(2, 2, 1, "zero3", 4),
    "pp2-dp2-ep2-zbh1": _plan(2, 2, 1, "replicate", 4, schedule="zb-h1"),
    "pp1-dp2-tp2-ep2-full": _plan(1, 2, 2, "replicate", 4, checkpointing="full"),
}
RESUMED = _plan(1, 2, 2, "zero3", 4)


def _rows(run: Path) -> dict[int, dict]:
    return {d["step"]: d for d in map(json.loads, (run / "losses.jsonl").read_text().splitlines())}


def moe_cases(tmp: Path) -> list:
    """Every case, then the first layout's two steps and their resumption: 4 ranks each, their runs and
    spec in `tmp` (conftest's `pipeline_launch` runs them)."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = str(moe_spec(tmp))
    cfgs = [case(spec, out=tmp / n, plan=plan, steps=STEPS, data="synthetic", progress=False,
                 checkpoint_every=STEPS if n == "pp2-dp2-ep2" else 0) for n, plan in CASES.items()]
    return cfgs + [case(spec, out=tmp / "first-half", plan=CASES["pp2-dp2-ep2"], steps=2, data="synthetic",
                        progress=False, checkpoint_every=2),
                   case(spec, out=tmp / "resumed", plan=RESUMED, steps=STEPS, data="synthetic", progress=False,
                        checkpoint_every=0, resume_from=tmp / "first-half")]


@pytest.fixture(scope="module")
def launched(pipeline_launch) -> Path:
    return pipeline_launch / "moe"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CASES, "resumed"])
def test_moe_with_expert_parallelism_equals_one_process(launched: Path, name: str) -> None:
    plan = CASES.get(name, RESUMED)
    losses, norms, _ = reference_run(moe_spec(launched), MB, plan.num_microbatches, plan.dp, STEPS)
    rows = _rows(launched / name)
    steps = range(3, STEPS + 1) if name == "resumed" else range(1, STEPS + 1)
    assert sorted(s for s in rows if s in steps) == list(steps)
    for s in steps:
        got, want = (rows[s]["loss"], rows[s]["grad_norm"]), (losses[s - 1], norms[s - 1])
        assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want)), (name, s, got, want)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_the_moe_checkpoint_exports_as_mixtral(launched: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from geotrain.models.llama import build_model
    from geotrain.runtime.hf_export import checkpoint_model_tensors, export_run, latest_checkpoint

    run = launched / "pp2-dp2-ep2"
    out, spec = export_run(run, tmp_path / "hf")
    doc = json.loads((out / "config.json").read_text())
    assert (doc["model_type"], doc["num_local_experts"], doc["num_experts_per_tok"]) == ("mixtral", 4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    model = build_model(spec).eval()
    model.load_state_dict(checkpoint_model_tensors(latest_checkpoint(run)))
    tokens = torch.randint(0, spec.vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)
