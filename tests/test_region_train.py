"""Training a region plan: tiny_2dc's pp=2 x dp=2 with DP pipeline 0 in east and pipeline 1 in
west (`Plan.replica_dcs`), so each pipeline stays inside one DC and only the gradient reduction
crosses the emulated link. One run with the built-in launcher over the kernel WAN (root; CI runs
as root); its losses match the ordinary pp=2 x dp=2 run of the same job (the session's
`tiny_2dc_builtin_run`), each rank reports the address of the DC the plan puts it in, the
reduction's bytes are counted on the emulated link, and the prediction beside the run numbers
ranks the way the run did.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import geotrain

from geotrain.layout.plan import StagePlan, load_plan, save_plan
from geotrain.planner.manual import plan_from_job
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
STEPS = 3
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="network namespaces need root (CI runs as root: never skipped there)")


def region_plan():
    spec = load_spec(SPEC)
    base = plan_from_job(spec)                        # stage 0 in east, stage 1 in west
    plan = base.with_(stages=tuple(StagePlan(dc="east", chunks=st.chunks) for st in base.stages),
                      replica_dcs=("east", "west"), links=(), name="tiny-region")
    return spec, plan


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def _forward_stages(trace: Path) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for line in trace.read_text().splitlines()[1:]:
        e = json.loads(line)
        if e["kind"] == "forward":
            out.setdefault(e["rank"], set()).add(e["stage"])
    return out


@pytest.fixture(scope="module")
def region_run(tmp_path_factory):
    spec, plan = region_plan()
    tmp = tmp_path_factory.mktemp("region")
    save_plan(tmp / "region.json", plan, spec=spec)
    out = tmp / "run"
    rc, stdout, err = geotrain(None, "train", tmp / "region.json", "--steps", STEPS, "--wan", "kernel", "--data",
                               "synthetic", "--out", out, env={"OMP_NUM_THREADS": "1"})
    assert rc == 0, (stdout + err)[-4000:]
    return plan, out, stdout


@pytest.mark.netns
@needs_root
def test_a_region_plan_trains_each_pipeline_in_its_dc(region_run, tiny_2dc_builtin_run):
    plan, out, stdout = region_run
    assert load_plan(out / "plan.json")[0].replica_dcs == ("east", "west")
    # The same math as the ordinary layout of the same job: only where the ranks sit differs.
    mine, theirs = _losses(out), _losses(tiny_2dc_builtin_run)
    assert len(mine) == STEPS and mine == pytest.approx(theirs, rel=1e-5)
    # Where each rank ran, as its own network stack reports it, against the DC the plan names.
    address = dict(re.findall(r"(\w+) (10\.77\.\d+\.\d+)", stdout.split("WAN: kernel emulation", 1)[1].splitlines()[0]))
    seen = json.loads((out / "summary.json").read_text())["address_per_rank"]
    assert seen == [address[plan.dc_of_rank(r)] for r in range(plan.num_ranks)], (seen, address)
    assert len(set(seen)) == 2 and "east ranks 0-1; west ranks 2-3" in stdout
    # No pipeline transfer crosses a DC: the trace has none on a WAN link ...
    trace = (out / "measured_trace.jsonl").read_text().splitlines()[1:]
    assert not [x for x in trace if json.loads(x).get("link")]
    # ... yet the emulated link carried the gradient reduction: per step each DC's replica sends at
    # least half its gradients (2 bytes each, bf16 at the least) in a two-rank reduce-scatter, i.e.
    # `params` bytes (0.64 MB in 3 steps; the ordinary layout, whose reduction stays inside a DC,
    # puts ~0.5 MB in all on the link; this one ~4.4 MB: zero3 also gathers the parameters).
    crossed = json.loads((out / "wan_bytes.json").read_text())
    params = load_spec(SPEC).model.shape.param_count()
    for dc in ("east", "west"):
        assert crossed[dc]["out"] > STEPS * params, crossed


@pytest.mark.netns
@needs_root
def test_the_prediction_beside_a_region_run_numbers_ranks_like_the_run(region_run):
    plan, out, _ = region_run
    want = {r: {plan.coords(r)[0]} for r in range(plan.num_ranks)}
    assert _forward_stages(out / "measured_trace.jsonl") == want
    assert _forward_stages(out / "predicted_trace.jsonl") == want
    # `geotrain train` also recorded what else the machine ran meanwhile, for the report's notes.
    load = json.loads((out / "machine_load.json").read_text())
    assert load["background_runnable"] >= 0 and load["samples"] > 0 and load["cores"] >= 1


def test_torchrun_hosts_of_a_region_plan_follow_its_dcs():
    """Under torchrun (one per DC, e.g. `geotrain rehearse`) `train --dc` checks this host's node
    ranks against the plan: a region plan's DCs are its pipelines' DCs, not its stages'."""
    from geotrain.errors import GeotrainError
    from geotrain.orchestrate.rehearsal import dc_blocks
    from geotrain.runtime.train_config import check_host_dc as _check_host_dc

    _, plan = region_plan()
    assert dc_blocks(plan) == [("east", [0, 1]), ("west", [2, 3])]     # one torchrun per DC can start them
    for rank, dc in enumerate(("east", "east", "west", "west")):
        _check_host_dc(plan, rank, dc)
    with pytest.raises(GeotrainError, match=r"rank 1 is stage 1 in east by the plan \(DP pipeline 0\)"):
        _check_host_dc(plan, 1, "west")


@pytest.mark.netns
@needs_root
def test_rehearse_runs_a_region_plan_one_torchrun_per_pipeline_dc(region_run, tmp_path):
    """The region plan as a two-host deployment: one torchrun per DC of its pipelines (node ranks
    contiguous per host), bit for bit the built-in launcher's run, the reduction on the link."""
    plan, builtin, _ = region_run
    out = tmp_path / "rehearse"
    r = subprocess.run([sys.executable, "-m", "geotrain.cli", "rehearse", str(builtin / "plan.json"), "--steps",
                        str(STEPS), "--data", "synthetic", "--out", str(out), "--compare-with", str(builtin),
                        "--timeout", "240"], env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert re.search(r"east 10\.77\.1\.2 ranks 0-1, west 10\.77\.2\.2 ranks 2-3", r.stdout), r.stdout
    report = json.loads((out / "rehearse.json").read_text())
    assert report["losses_identical"] and len(report["losses"]) == STEPS
    assert report["links"] == []                     # no pipeline boundary crosses a DC
    params = load_spec(SPEC).model.shape.param_count()
    assert all(report["link_bytes"][dc]["out"] > STEPS * params for dc in ("east", "west")), report["link_bytes"]
    seen = json.loads((out / "summary.json").read_text())["address_per_rank"]
    assert seen == ["10.77.1.2", "10.77.1.2", "10.77.2.2", "10.77.2.2"]


def test_the_simulator_and_the_report_number_a_region_plans_ranks_like_the_runtime():
    """The simulated trace names ranks by Plan.rank (pipeline-major here), and the report names a
    stage's DCs and ranks as the plan places them (its replicas span east and west)."""
    from geotrain.report.html import plan_section
    from geotrain.report.summary import stage_rows
    from geotrain.sim import simulate
    from geotrain.trace.rank_roles import rank_layout

    spec, plan = region_plan()
    res = simulate(spec, plan)
    cols = res.trace.columns()
    fwd = cols.kind_mask(("forward",))
    for r, s in zip(cols.rank[fwd].tolist(), cols.stage[fwd].tolist()):
        assert plan.coords(r)[0] == s % plan.pp
    layout = rank_layout(res.trace, plan)
    assert [i.dc for i in layout] == ["east", "east", "west", "west"]
    assert [row.dc for row in stage_rows(res.metrics, layout)] == ["east+west", "east+west"]
    assert "<td>r0, r2</td>" in plan_section(plan) and "<td>east+west</td>" in plan_section(plan)


@pytest.mark.netns
@needs_root
def test_the_region_runs_link_bytes_are_the_plans_wan_bytes(region_run):
    """What the emulated link counted (RUN_DIR/wan_bytes.json) against layout.wan_bytes, printed
    beside it and in the report's row: with gloo's reduce-scatter (an all-reduce on the wire) and
    zero3's 5 gathers per stage (1f1b, 4 micro-batches) 1.02-1.03x under the counters (TCP/IP:
    docs/DECISIONS.md, WAN bytes); NCCL's count is 1.19x under, the old count 2.4x."""
    from geotrain.layout.wan_bytes import predicted_link_bytes
    from geotrain.report.build import rebuild

    plan, out, stdout = region_run
    spec = load_spec(SPEC)
    crossed = json.loads((out / "wan_bytes.json").read_text())
    predicted = predicted_link_bytes(spec, plan, STEPS, backend="gloo")     # the run's ranks are CPU ranks
    for dc in ("east", "west"):
        assert 1.0 < crossed[dc]["out"] / predicted[dc]["out"] < 1.06, (crossed, predicted)
    assert re.search(r"WAN bytes predicted \(layout.wan_bytes, 3 iterations, gloo\): east sent [\d.]+ MiB", stdout), \
        stdout
    row = {r.metric: r for r in rebuild(out)[0].comparison}["WAN bytes per iteration"]
    assert row.measured == pytest.approx(sum(d["out"] for d in crossed.values()) / STEPS, abs=1)
    assert 1.0 < row.measured / row.predicted < 1.3 and "gloo" in row.note, row    # the prediction counts NCCL's
