"""Tensor parallelism inside a stage trains exactly like one process training the whole model.

The cases run back to back in test_runtime_pipeline's launch of 4 local ranks (conftest's
`pipeline_launch`: process start-up is paid once):
pp=2 x dp=1 x tp=2 and pp=1 x dp=2 x tp=2, replicated and ZeRO-3 (FSDP2 over dp composed with
TP over tp), plus a zero-bubble schedule over ZeRO-3, fp32. Each case's per-step losses must match
a single-process reference on the same batches (relative 1e-5). A second launch, through
`geotrain train`, trains a tiny spec with tp=2 across two datacenters over the user-space WAN shaper.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cases import case
from _reference import reference_run
from test_runtime_pipeline import recipe_spec

from geotrain.errors import GeotrainError
from geotrain.layout.plan import Plan, StagePlan
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
CLUSTER = ROOT / "examples" / "clusters" / "tiny_2dc.toml"
STEPS = 4
MICRO_BATCH = 2


def _plan(pp: int, dp: int, m: int, **kw) -> Plan:
    """A fp32 tp=2 plan of the tiny model: pp stages (east, then west) of even unit ranges."""
    from geotrain.planner.manual import split_even

    spec = load_spec(SPEC)
    ranges = split_even(spec.model.num_units, pp)
    stages = tuple(StagePlan(dc=("east", "west")[s], chunks=(ranges[s],)) for s in range(pp))
    return Plan(stages=stages, dp=dp, tp=2, micro_batch=MICRO_BATCH, num_microbatches=m, precision="fp32",
                name=f"tp-pp{pp}-dp{dp}", **kw)


# (name, pp, dp, micro-batches per replica, plan fields)
CASES = [
    ("pp2-dp1-tp2-replicate", 2, 1, 4, {"schedule": "1f1b", "sharding": "replicate"}),
    ("pp2-dp1-tp2-zero3", 2, 1, 4, {"schedule": "1f1b", "sharding": "zero3"}),
    ("pp1-dp2-tp2-replicate", 1, 2, 2, {"schedule": "gpipe", "sharding": "replicate"}),
    ("pp1-dp2-tp2-zero3", 1, 2, 2, {"schedule": "gpipe", "sharding": "zero3", "checkpointing": "full"}),
    # A split backward (zero-bubble) over FSDP2 zero3 + TP: the weight gradients must name the gathered weights.
    ("pp2-dp1-tp2-zbh1-zero3", 2, 1, 4, {"schedule": "zb-h1", "sharding": "zero3", "checkpointing": "full"}),
]


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines() if line.strip()]


def tp_cases(tmp: Path) -> list:
    """CASES, 4 ranks each, their runs and spec in `tmp` (conftest's `pipeline_launch` runs them)."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = recipe_spec(tmp)          # warm-up, cosine, weight decay, clipping that acts
    # pp=1 x dp=2 x tp=2 puts 4 ranks in east: the same experiment on DCs of 4 GPUs (a plan is
    # checked against its spec's GPUs before any rank starts)
    (tmp / "cluster4.toml").write_text(CLUSTER.read_text().replace("gpus = 2\n", "gpus = 4\n"))
    spec.write_text(spec.read_text().replace(f'cluster = "{CLUSTER}"', f'cluster = "{tmp / "cluster4.toml"}"'))
    cases = [case(spec, out=str(tmp / name), plan=_plan(pp, dp, m, **kw), steps=STEPS,
                       data="synthetic", progress=False, checkpoint_every=0)
             for name, pp, dp, m, kw in CASES]
    return cases


@pytest.fixture(scope="module")
def launched(pipeline_launch) -> Path:
    return pipeline_launch / "tp"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tp_matches_single_process(launched: Path, case) -> None:
    """Losses and the clipped global gradient norm (TP shards summed, replicated norms counted once,
    FSDP2 shards summed, across the stages) equal the single process's."""
    name, pp, dp, m, _ = case
    rows = read_rows(launched / name)
    got, norms = [x["loss"] for x in rows], [x["grad_norm"] for x in rows]
    want, want_norms, _ = reference_run(launched / "tiny_2dc_recipe.toml", MICRO_BATCH, m, dp, STEPS)
    assert len(got) == STEPS and want_norms[0] > 0.4
    for g, w in zip(got + norms, want + want_norms):
        assert abs(g - w) <= 1e-5 * abs(w), (name, got, want, norms, want_norms)
    assert got[-1] < got[0]  # the model learned: equal losses are not equal by accident of a frozen model


@pytest.mark.slow
def test_tp_boundary_sends_one_slice_per_tp_rank(launched: Path) -> None:
    """At an equal-tp boundary (east -> west, tp 2 both) each TP rank sends only its 1/tp slice of
    the activation (and gradient) to the same TP index, which all-gathers them: every cross-DC
    transfer is half a boundary tensor, and each of the 4 ranks sends one per micro-batch."""
    from geotrain.trace.schema import Trace

    spec = load_spec(SPEC).model
    whole = MICRO_BATCH * spec.seq_len * spec.hidden * 4          # fp32
    trace = Trace.read_jsonl(launched / "pp2-dp1-tp2-replicate" / "measured_trace.jsonl")
    sent = [e for e in trace.events if e.kind == "transfer"]
    assert sent and {e.bytes for e in sent} == {whole // 2}, {e.bytes for e in sent}
    per_rank = {r: sum(e.bytes for e in sent if e.rank == r) for r in range(4)}
    assert per_rank == {r: STEPS * 4 * whole // 2 for r in range(4)}, per_rank   # m=4 micro-batches a step


@pytest.mark.slow
def test_tp_shards_the_block_weights(launched: Path) -> None:
    """Each TP rank holds half of every block weight (and the embedding/head whole): TP really split them."""
    from geotrain.models.llama import build_units

    spec = load_spec(SPEC)
    full = sum(p.numel() * 4 for p in build_units(spec.model, 0, spec.model.num_units).parameters())
    per_block = sum(p.numel() * 4 for n, p in build_units(spec.model, 1, 2).named_parameters() if p.dim() == 2)
    summary = json.loads((launched / "pp1-dp2-tp2-replicate" / "summary.json").read_text())
    held = [m["params"] for m in summary["memory_per_rank"]]
    want = full - spec.model.layers * per_block // 2
    assert held == [want] * 4, (held, want)


def test_tp_layout_errors_are_one_line(tmp_path: Path) -> None:
    spec = load_spec(SPEC)
    with pytest.raises(GeotrainError, match="wider than a node of datacenter east"):
        case(SPEC, plan=_plan(2, 1, 4).with_(tp=4))
    from geotrain.layout.tp_check import tp_problem

    def with_nodes(gpus_per_node: int):
        return spec.cluster.model_copy(update={"datacenters": [
            d.model_copy(update={"gpus_per_node": gpus_per_node}) for d in spec.cluster.datacenters]})

    assert "tp=3 does not divide the 8 GPUs per node of datacenter east" in \
        tp_problem(spec.model, _plan(2, 1, 4).with_(tp=3), with_nodes(8))
    assert "does not divide model tiny's kv_heads=2" in tp_problem(spec.model, _plan(2, 1, 4).with_(tp=4),
                                                                   with_nodes(4))
    assert tp_problem(spec.model, _plan(2, 1, 4), spec.cluster) is None
    with pytest.raises(GeotrainError, match="zero1"):
        case(SPEC, plan=_plan(2, 1, 4, sharding="zero1"))


def test_selective_checkpointing_with_a_split_backward_is_refused() -> None:
    with pytest.raises(GeotrainError, match="selective checkpointing cannot run under the zb-h1"):
        case(SPEC, plan=_plan(2, 1, 4, schedule="zb-h1", checkpointing="selective"))
    case(SPEC, plan=_plan(2, 1, 4, schedule="1f1b", checkpointing="selective"))


def test_wan_routes_each_tp_rank_to_its_own_peer(tmp_path: Path) -> None:
    """Over the WAN, rank (stage, replica, t) sends to (other stage, replica, t) through the WAN
    transport, for every t -- not only t = 0."""
    import torch.distributed as dist

    from geotrain.runtime.rank_run import build_transport
    from geotrain.runtime.train_config import WanConfig
    from geotrain.schedule.builders import schedule_for_plan

    spec = load_spec(SPEC)
    plan = _plan(2, 1, 4)
    schedule = schedule_for_plan(plan)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for rank in range(plan.num_ranks):
            stage, replica, t = plan.coords(rank)
            transport = build_transport(WanConfig(mode="shaper"), spec, plan, schedule, rank,
                                        p2p_groups={})     # one process plays every rank: no real groups
            try:
                peer = plan.rank(1 - stage, replica, t)
                other = plan.rank(1 - stage, replica, 1 - t)
                assert transport.route(peer) is not transport.default, rank
                assert transport.route(other) is transport.default, rank
            finally:
                transport.close()
    finally:
        dist.destroy_process_group()


def test_a_sites_groups_are_reused_only_for_the_same_members_in_the_same_world() -> None:
    """runtime.meshes.reused_groups: a launch's later cases get the groups an earlier case made at the
    same site for the same members (every rank decides alike); other members, another site or a new
    world get new groups."""
    import torch.distributed as dist

    from geotrain.runtime.meshes import reused_groups

    last = None
    for _world in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            if last is not None:                 # the same lists in a new world: not the old world's groups
                assert reused_groups("test", [[0]])[0] is not last
            first = reused_groups("test", [[0], [0]])
            assert first[0] is not first[1]                      # one group per list, even for equal members
            assert reused_groups("test", [[0], [0]]) == first    # the next case: the same groups
            assert reused_groups("other", [[0], [0]])[0] not in first
            last = reused_groups("test", [[0]])[0]               # other lists: new groups
            assert last not in first
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
def test_geotrain_train_with_tp2_end_to_end(tmp_path: Path, capsys) -> None:
    from geotrain.cli import main

    spec = tmp_path / "tiny_tp.toml"
    spec.write_text(f"""name = "tiny-tp"
cluster = "{CLUSTER}"
model = "tiny"

[job]
global_batch = 8
micro_batch = 2
precision = "bf16"
sharding = "zero3"
schedule = "1f1b"
pp = 2
dp = 1
tp = 2
steps = 3
lr = 1e-3
""")
    out = tmp_path / "run"
    assert main(["train", str(spec), "--out", str(out), "--wan", "shaper", "--no-progress",
                 "--checkpoint-every", "0"]) == 0, capsys.readouterr().err
    losses = [x["loss"] for x in read_rows(out)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizer_steps_per_rank"] == [3] * 4
    logs = "".join(p.read_text() for p in sorted((out / "logs").glob("rank*.log")))
    assert logs.count("StripedTransport") == 4  # every rank, t = 0 and t = 1, sends over the WAN transport
