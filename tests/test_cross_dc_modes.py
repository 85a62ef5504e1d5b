"""The cross-DC modes the planner prices and chooses among (planner.modes, sim.outer,
layout.outer_cost): every mode side by side, `cross_dc = "auto"` picking by throughput among the
modes whose loss cost is accepted, `"diloco"` the job's own settings; the simulator's DiLoCo
timeline and per-step price; WAN bytes of the outer exchange."""

from __future__ import annotations

from pathlib import Path

import pytest
from _small_clusters import write_spec

from geotrain.errors import GeotrainError
from geotrain.layout.outer_cost import exchange_bytes
from geotrain.layout.wan_bytes import wan_bytes_per_direction
from geotrain.planner.confirm import make_plan
from geotrain.planner.loss_table import BUILTIN, LossRow, load_rows, lookup
from geotrain.planner.modes import format_modes, groupings
from geotrain.sim import simulate

SLOW = [("A", "B", 40, 2, 0.5)]        # 2 Gbit/s, 40 ms: pipelines of a 7B model starve


class _Inline(str):
    """A TOML inline table as write_spec writes values (their repr)."""

    def __repr__(self) -> str:
        return str(self)


def _spec(tmp: Path, links=SLOW, dcs=(("A", "a100-80g", 16), ("B", "a100-80g", 16)), **job):
    base = {"global_batch": 64, "micro_batch": 1, "precision": "bf16"}
    if "diloco" in job:
        job["diloco"] = _Inline("{" + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in job["diloco"].items())
                                + "}")
    return write_spec(tmp, list(dcs), links, "llama2-7b", {**base, **job})


def _table(tmp: Path, gap: float) -> str:
    (tmp / "loss.toml").write_text(f"""
[[row]]
mode = "diloco"
inner_steps = 32
compression = "int8"
gap = {gap}
label = "test row"

[[row]]
mode = "diloco"
inner_steps = 32
fragments = 4
compression = "int4"
gap = {2 * gap}
""")
    return str(tmp / "loss.toml")


def test_compare_lists_every_mode_with_throughput_bytes_and_loss_cost(tmp_path):
    spec = _spec(tmp_path, cross_dc="auto", loss_table=_table(tmp_path, 0.004))
    res = make_plan(spec)
    modes = {r.mode for r in res.modes}
    assert {"pipeline", "sync-dp", "hier-dp", "diloco", "streaming"} <= modes
    by = {r.label: r for r in res.modes}
    assert by["pipeline"].gap == by["sync-dp"].gap == by["hier-dp"].gap == 0.0
    assert by["diloco H=32 int8"].gap == 0.004 and "test row" in by["diloco H=32 int8"].loss_note
    # the job's own fp32 DiLoCo: no row of the user's, so the built-in table's (bench_cross_dc's)
    builtin = lookup(load_rows(BUILTIN, "built-in"), "diloco", "fp32", 32)
    assert by["diloco H=32"].gap == builtin.gap and "tiny Llama" in by["diloco H=32"].loss_note
    # a codec no table measured says so
    bf16 = make_plan(_spec(tmp_path / "bf16", cross_dc="auto", loss_table=_table(tmp_path, 0.004),
                           diloco={"compression": "bf16"}))
    own = next(r for r in bf16.modes if r.label == "diloco H=32 bf16")
    assert own.gap is None and own.loss_note == "not measured"
    # the flat ring pays 2 (N-1) WAN latencies: slower than the hierarchical one
    assert by["sync-dp"].iteration_s > by["hier-dp"].iteration_s
    # an outer exchange per 32 steps moves far fewer WAN bytes per token than synchronous DP
    assert by["diloco H=32"].wan_bytes < by["hier-dp"].wan_bytes / 10
    text = "\n".join(format_modes(spec, res.modes, res.plan))
    for label in by:
        assert label in text


def test_auto_picks_the_fastest_mode_whose_loss_cost_is_accepted(tmp_path):
    table = _table(tmp_path, 0.004)
    # DiLoCo int8 (measured +0.4 %) and streaming int4 (+0.8 %) are faster than the pipeline here
    strict = make_plan(_spec(tmp_path / "a", cross_dc="auto", loss_table=table))
    assert strict.plan.outer is None                          # nothing with a loss cost is accepted
    loose = make_plan(_spec(tmp_path / "b", cross_dc="auto", loss_table=table, max_loss_gap=0.005))
    assert loose.plan.outer is not None and loose.plan.outer.compression == "int8"
    assert loose.explanation[0].startswith("cross_dc = auto chose diloco H=32 int8")
    assert any("streaming" in line and "> max_loss_gap" in line for line in loose.explanation)
    looser = make_plan(_spec(tmp_path / "c", cross_dc="auto", loss_table=table, max_loss_gap=0.01))
    assert looser.plan.outer.fragments == 4                   # streaming now accepted, and fastest
    allowed = make_plan(_spec(tmp_path / "d", cross_dc="auto", cross_dc_allow=["diloco"]))
    assert allowed.plan.outer is not None                     # allowed whatever its (unmeasured) loss
    fastest = max((r for r in allowed.modes if r.ok and r.plan is not None), key=lambda r: r.tokens_per_s)
    assert allowed.plan is fastest.plan


def test_diloco_mode_takes_the_jobs_own_settings(tmp_path):
    spec = _spec(tmp_path, cross_dc="diloco", diloco={"inner_steps": 16, "compression": "bf16"})
    res = make_plan(spec)
    o = res.plan.outer
    assert (o.inner_steps, o.compression, o.lr, o.momentum, o.nesterov) == (16, "bf16", 0.7, 0.9, True)
    assert [set(w) for w in o.workers] == [{"A"}, {"B"}]
    assert res.plan.global_batch == 64 and res.plan.num_workers == 2
    assert "DiLoCo: inner step" in res.bottleneck
    one = _spec(tmp_path / "one", dcs=(("A", "a100-80g", 16),), links=[], cross_dc="diloco")
    with pytest.raises(GeotrainError, match="no DiLoCo layout"):
        make_plan(one)


def test_hybrid_groups_near_dcs_into_workers(tmp_path):
    dcs = [(n, "a100-80g", 16) for n in "ABCD"]
    near, far = (1, 100, 25), (60, 1, 0.25)
    links = [("A", "B", *near), ("C", "D", *near)] + [(a, b, *far) for a in "AB" for b in "CD"]
    spec = _spec(tmp_path, links=links, dcs=dcs, cross_dc="diloco")
    kinds = dict((m, sorted(map(sorted, g))) for m, g in groupings(spec))
    assert kinds["hybrid"] == [["A", "B"], ["C", "D"]]
    res = make_plan(spec)
    rows = {r.mode: r for r in res.modes}
    assert rows["hybrid"].ok and rows["hybrid"].plan.num_workers == 2


def test_a_diloco_plans_simulated_step_is_inner_step_plus_its_share_of_each_exchange(tmp_path):
    spec = _spec(tmp_path, cross_dc="diloco", diloco={"inner_steps": 8})
    plan = make_plan(spec).plan
    base = simulate(spec, plan)
    out, inner = base.outer, base.inner.iteration_time
    assert out.exposed_s == out.exchange_s > 0
    assert base.iteration_time == pytest.approx(inner + (out.exchange_s + out.optimizer_s) / 8)
    # streaming: 4 fragments of a quarter each, every exchange overlapped with one inner step
    st = simulate(spec, plan.with_(outer=plan.outer.__class__(**{**plan.outer.__dict__, "fragments": 4,
                                                                  "overlap": 1})))
    assert st.outer.exchange_bytes[("A", "B")] == pytest.approx(out.exchange_bytes[("A", "B")] / 4, rel=1e-3)
    assert st.outer.exposed_s == pytest.approx(max(0.0, st.outer.exchange_s - st.inner.iteration_time))
    # the timeline: each fragment's exchange once per period on both link directions
    syncs = [e for e in st.trace.events if e.kind == "outer_sync"]
    assert sorted({e.stage for e in syncs}) == [0, 1, 2, 3]
    assert all(sum(1 for e in syncs if e.stage == f) == 2 for f in range(4))
    assert {e.link for e in syncs} == {"A->B", "B->A"}
    waits = [e for e in st.trace.events if e.kind == "outer_wait"]
    assert all(w.end - w.start == pytest.approx(st.outer.exposed_s) for w in waits)


def test_the_outer_exchange_is_counted_in_the_plans_wan_bytes(tmp_path):
    spec = _spec(tmp_path, cross_dc="diloco", diloco={"inner_steps": 32, "compression": "int8"})
    plan = make_plan(spec).plan
    from geotrain.costs import CostModel

    per_exchange = exchange_bytes(CostModel(spec.model, precision=plan.precision), plan)[0]
    params = CostModel(spec.model).stage_params(range(len(plan.stages[0].units)))
    # per exchange each direction carries 2 / k of the model, one byte per int8 value (+ block scales)
    assert per_exchange[("A", "B")] == pytest.approx(params * (1 + 4 / 128), rel=0.01)
    assert wan_bytes_per_direction(spec, plan)[("A", "B")] == pytest.approx(per_exchange[("A", "B")] / 32)


def test_loss_table_rows_match_by_mode_codec_and_nearest_h(tmp_path):
    rows = [LossRow("diloco", 0.01, 8), LossRow("diloco", 0.02, 32), LossRow("diloco", 0.05, 128),
            LossRow("diloco", 0.03, 32, fragments=4, compression="int4"), LossRow("compressed", 0.001,
                                                                                  compression="int8")]
    assert lookup(rows, "diloco", "fp32", 16).gap == 0.02      # as near to H 8 as to 32: the larger gap
    assert lookup(rows, "diloco", "fp32", 100).gap == 0.05
    assert lookup(rows, "diloco", "int4", 32, 4).gap == 0.03
    assert lookup(rows, "diloco", "int4", 32, 1) is None
    assert lookup(rows, "compressed", "int8").gap == 0.001
    (tmp_path / "bad.toml").write_text("[[row]]\nmode = 'diloco'\n")
    with pytest.raises(GeotrainError, match="needs mode and gap"):
        load_rows(tmp_path / "bad.toml", "user")
