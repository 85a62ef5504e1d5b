"""A 3-DC line (a-b, b-c; no a-c link): torch.distributed connects every pair of ranks, so no plan may put
ranks in a and c. The planner lists no such chain, a pinned job is refused in one line, and a plan file
that does it is refused in one line by simulate and train before anything starts (it used to hang)."""

from __future__ import annotations

from pathlib import Path

from _cli import geotrain

from geotrain.layout.plan import StagePlan, save_plan
from geotrain.layout.reach import reach_problem
from geotrain.planner.manual import plan_from_job
from geotrain.planner.placement import chains
from geotrain.spec.load import load_spec

LINK = "latency_ms = 5\ncapacity_gbps = 1.0\nper_connection_gbps = 0.5\nmax_connections = 4\n"


def _line(tmp: Path, pp: int | None = 3) -> Path:
    dcs = "".join(f'[[datacenters]]\nname = "{d}"\ngpu_type = "cpu"\ngpus = 1\ngpus_per_node = 1\n' for d in "abc")
    links = "".join(f'[[wan_links]]\nbetween = ["{x}", "{y}"]\n{LINK}' for x, y in (("a", "b"), ("b", "c")))
    (tmp / "cluster.toml").write_text(f'name = "line3"\n{dcs}{links}')
    pins = f"pp = {pp}\ndp = 1\n" if pp else ""
    (tmp / "line.toml").write_text(
        'name = "line"\ncluster = "cluster.toml"\nmodel = "tiny"\n[job]\nglobal_batch = 4\nmicro_batch = 1\n'
        f'precision = "fp32"\ncheckpointing = "none"\nsharding = "replicate"\nschedule = "1f1b"\n{pins}'
        "steps = 2\nlr = 1e-3\n")
    return tmp / "line.toml"


def test_the_planner_lists_no_chain_through_an_unlinked_pair(tmp_path):
    spec = load_spec(_line(tmp_path))
    found = chains(spec.cluster)
    assert ("a", "b") in found and ("b", "c") in found
    assert not [c for c in found if {"a", "c"} <= set(c)]


def test_a_pinned_line_is_refused_in_one_line(tmp_path):
    rc, out, err = geotrain(None, "validate", _line(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "linked pairwise" in err and "a-b" in err


def test_a_plan_file_across_the_line_is_refused_before_anything_starts(tmp_path):
    spec = load_spec(_line(tmp_path, pp=2))
    two = plan_from_job(spec)                                 # pp=2 on a linked pair
    n = spec.model.num_units
    cuts = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    plan = two.with_(stages=tuple(StagePlan(dc=d, chunks=(c,)) for d, c in zip("abc", cuts)), links=(),
                     name="across")                           # every hop linked, the ends not
    assert reach_problem(two, spec.cluster) is None
    assert "a and c" in reach_problem(plan, spec.cluster)
    save_plan(tmp_path / "across.json", plan, spec=spec)
    for cmd in (["simulate", tmp_path / "across.json", "--out", tmp_path / "sim", "--no-progress"],
                ["train", tmp_path / "across.json", "--out", tmp_path / "run", "--no-progress", "--steps", "1"]):
        rc, out, err = geotrain(None, *cmd)
        assert rc == 2, (cmd, out, err)
        assert "no WAN link joins" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "logs").exists()
