"""`geotrain rehearse`: tiny_2dc (pp=2 x dp=2) as a two-host deployment on this machine -- one
torchrun per emulated datacenter inside its network namespace, c10d rendezvous across the kernel
WAN -- trains bit for bit like the built-in launcher's run of the same plan, and what it measured
on each link (connections counted by `ss` in the namespaces, turns recorded by the transport)
is what the plan says. Root only (network namespaces); CI runs as root, so there it never skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from geotrain.errors import GeotrainError
from geotrain.layout.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "tiny_2dc.toml"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
needs_root = pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                reason="network namespaces need root (CI runs as root: never skipped there)")


def _rehearse(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "geotrain.cli", "rehearse", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def _losses(run: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "losses.jsonl").read_text().splitlines() if x.strip()]


def _temporal_plan_file(where: Path) -> Path:
    """tiny_2dc's plan with its link shared in turns over 4 connections. The planner keeps fair
    sharing on the link's own 1 Gbit/s (a 16 KiB transfer takes less than a turn costs:
    test_plan_sharing); this test is about the mechanisms, so it asks for them."""
    from geotrain.layout.plan import save_plan
    from geotrain.planner.confirm import make_plan
    from geotrain.planner.sharing import apply_temporal, with_connections
    from geotrain.spec import load_spec

    spec = load_spec(SPEC)
    plan = with_connections(make_plan(spec).plan, [4])
    path = where / "temporal_plan.json"
    save_plan(path, apply_temporal(plan, spec.cluster, 16384, 0.0), spec=spec)
    return path


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, tiny_2dc_builtin_run):
    out = tmp_path_factory.mktemp("rehearse") / "run"
    r = _rehearse(str(_temporal_plan_file(out.parent)), "--steps", "3", "--data", "synthetic", "--out", str(out),
                  "--compare-with", str(tiny_2dc_builtin_run), "--timeout", "240")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return out, r, json.loads((out / "rehearse.json").read_text())


@pytest.mark.netns
@needs_root
def test_rehearse_trains_bit_for_bit_like_the_built_in_launcher(rehearsal, tiny_2dc_builtin_run):
    out, r, report = rehearsal
    mine_plan, theirs = load_plan(out / "plan.json")[0], load_plan(tiny_2dc_builtin_run / "plan.json")[0]
    assert mine_plan.with_(links=theirs.links, name=theirs.name) == theirs    # the same plan, its link in turns
    mine = _losses(out)
    assert len(mine) == 3 and mine == _losses(tiny_2dc_builtin_run)
    assert report["losses_identical"] and "identical to the built-in launcher" in r.stdout
    # One torchrun per DC, each rank's cross-DC link on the direct striped transport bound to its namespace.
    lines = [ln for dc in ("east", "west") for ln in (out / "logs" / f"{dc}.log").read_text().splitlines()
             if "geotrain wan: rank" in ln]
    assert len(lines) == 4 and all("StripedTransport" in ln and "direct (listening on 10.77." in ln for ln in lines)
    # no secret file under torchrun: rank 0 says once that the run secret travels through the c10d store
    logs = "".join((out / "logs" / f"{dc}.log").read_text() for dc in ("east", "west"))
    assert logs.count("the run secret is shared through the rendezvous store") == 1


@pytest.mark.netns
@needs_root
def test_rehearse_measures_the_plans_connections_and_turns_on_each_link(rehearsal):
    out, _, report = rehearsal
    plan, _ = load_plan(out / "plan.json")
    links = {x["link"]: x for x in report["links"]}
    assert set(links) == {"east->west", "west->east"}
    for name, x in links.items():
        lp = plan.link_between(*name.split("->"))
        assert lp.sharing == "temporal" and lp.connections > 1, lp      # the plan exercises both mechanisms
        assert x["plan_connections"] == lp.connections
        # counted in the kernel: every sending rank held the plan's connections to its peer
        assert x["pairs"] == plan.dp and x["measured_connections_per_pair"] == [lp.connections] * plan.dp, x
        # recorded by the transport: every transfer took a turn, both pipelines took turns, one at a time
        assert x["transfers_per_iteration"] == plan.num_microbatches * plan.dp, x
        assert x["turns_per_iteration"] == x["transfers_per_iteration"], x
        assert x["turn_pipelines"] == plan.dp and x["turns_held_at_once"] == x["turn_slots"] == 1, x
        assert x["bytes_per_iteration"] > 0


@pytest.mark.netns
@needs_root
def test_rehearse_leaves_one_run_dir_and_no_namespaces(rehearsal):
    out, r, _ = rehearsal
    # the last stage's host writes the run directory; the other host only its ranks' own trace files
    for name in ("losses.jsonl", "measured_trace.jsonl", "summary.json", "plan.json", "predicted_trace.jsonl"):
        assert (out / name).is_file(), name
    assert not (out / "hosts" / "east" / "losses.jsonl").exists()
    ranks = {json.loads(x).get("rank") for x in (out / "measured_trace.jsonl").read_text().splitlines()[1:]}
    assert ranks == {0, 1, 2, 3}                 # each host wrote its own; rehearse copied them in and merged
    assert "rehearse: " in r.stdout and ("step(s) done" in r.stdout or "start-up" in r.stdout)   # no silent minute
    for log in (out / "logs").glob("*.log"):     # a clean run ends cleanly on every host (runtime.worker:
        text = log.read_text()                     # the store's host leaves last)
        assert "recvVector" not in text and "recvValue failed" not in text and "Traceback" not in text, text[-2000:]
    tag = r.stdout.split("(gt-", 1)[1].split("-*", 1)[0]
    assert not [ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
                if ln.startswith(f"gt-{tag}")]


def test_rehearse_refuses_serve_prefill_in_one_line(tmp_path):
    r = _rehearse(str(SPEC), "--serve-prefill", "0", "--out", str(tmp_path / "x"), timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--serve-prefill is not available under rehearse" in r.stderr


def test_a_host_started_in_the_wrong_node_order_is_refused():
    from geotrain.planner.manual import plan_from_job
    from geotrain.runtime.train_config import check_host_dc as _check_host_dc
    from geotrain.spec.load import load_spec

    plan = plan_from_job(load_spec(SPEC))            # ranks 0-1 in east, 2-3 in west
    _check_host_dc(plan, 0, "east")
    _check_host_dc(plan, 3, "west")
    with pytest.raises(GeotrainError, match="rank 0 is stage 0 in east") as e:
        _check_host_dc(plan, 0, "west")
    # the advice fits both rendezvous: c10d ignores --node-rank (it sorts hosts by --local-addr)
    assert "static rendezvous" in str(e.value) and "c10d rendezvous --node-rank is ignored" in str(e.value)
    with pytest.raises(GeotrainError, match="no such datacenter"):
        _check_host_dc(plan, 0, "north")


def test_listeners_and_kernel_connection_counts_are_read_as_the_ranks_log_them(tmp_path):
    from geotrain.orchestrate.rehearsal import listeners, measured_connections

    log = tmp_path / "west.log"
    log.write_text("geotrain wan: rank 2 (west) -> stage 0 (east): StripedTransport, 4 connections, temporal, turn "
                   "order [0, 1], direct (listening on 10.77.2.2:4100)\n"
                   "geotrain wan: rank 3 (west) -> stage 0 (east): StripedTransport, 2 connections, fair, direct, "
                   "TLS (listening on 10.77.2.2:4200)\n")
    found = listeners([log, tmp_path / "missing.log"])
    assert found == {"10.77.2.2:4100": (2, "west"), "10.77.2.2:4200": (3, "west")}
    a = {(f"10.77.1.2:{p}", "10.77.2.2:4100") for p in (5000, 5002, 5004)}
    b = {(f"10.77.1.2:{p}", "10.77.2.2:4100") for p in (5000, 5002, 5004, 5006)}
    gloo = {("10.77.1.2:6000", "10.77.2.2:29400")}
    same_dc = {("10.77.2.2:7000", "10.77.2.2:4200")}        # seen inside west's namespace: not a WAN connection
    counts = measured_connections([("east", a | gloo), ("east", b), ("west", same_dc)], found)
    assert counts == {("east", "west", 2): 4}          # the most seen at once, striped listeners only


def test_each_datacenter_is_one_block_of_ranks_in_plan_order():
    from geotrain.orchestrate.rehearsal import dc_blocks
    from geotrain.planner.manual import plan_from_job
    from geotrain.spec.load import load_spec

    plan = plan_from_job(load_spec(SPEC))
    assert dc_blocks(plan) == [("east", [0, 1]), ("west", [2, 3])]
    one_dc = plan.with_(stages=tuple(type(st)(**{**st.__dict__, "dc": "east"}) for st in plan.stages))
    assert dc_blocks(one_dc) == [("east", [0, 1, 2, 3])]      # one host (plan consistency: rehearsed too)


def test_the_link_table_stays_aligned_with_long_datacenter_names():
    from geotrain.orchestrate.rehearse_run import _link_lines

    row = {"measured_connections_per_pair": [2], "turns_per_iteration": 4, "turn_pipelines": 2, "plan_turns": False,
           "turn_slots": 1, "turns_held_at_once": 1, "plan_connections": 2, "sharing": "fair",
           "transfers_per_iteration": 8, "bytes_per_iteration": 1000 * 1024}
    lines = _link_lines([{**row, "link": "east->west"}, {**row, "link": "frankfurt-north-2->virginia-east-1"}])
    assert len({len(ln) for ln in lines[2:]}) == 1, lines        # every column where the header puts it
    assert lines[1].index("sharing") == lines[2].index("fair") == lines[3].index("fair"), lines
    assert "1000 KiB" in lines[2] and "e+" not in "".join(lines)
