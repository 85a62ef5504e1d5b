"""QA: a plan file that is not a well-formed plan is one clean SpecError, never a traceback."""

import json

import pytest

from geotrain.errors import SpecError
from geotrain.layout.plan import load_plan, save_plan
from geotrain.planner.manual import plan_from_job


@pytest.fixture
def good(tmp_path):
    from geotrain.spec import load_spec

    spec = load_spec("examples/tiny_2dc.toml")
    path = tmp_path / "plan.json"
    plan = plan_from_job(spec)
    plan = plan.with_(links=tuple(lp.__class__(**{**lp.__dict__, "connections": 4}) for lp in plan.links),
                      pipeline_offsets=(0.0, 0.001))
    save_plan(path, plan, spec_path="examples/tiny_2dc.toml", spec=spec)
    return path


def _edit(path, tmp_path, fn):
    doc = json.loads(path.read_text())
    fn(doc["plan"])
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def test_good_plan_round_trips(good):
    plan, doc = load_plan(good)
    assert plan.dp == 2 and doc["spec"] == "examples/tiny_2dc.toml"


@pytest.mark.parametrize("content, reason", [
    ("[1, 2]", "not a geotrain plan file"),
    ("\"text\"", "not a geotrain plan file"),
    (b"\x7fELF\x02\x01\x01\xd0\xff\xfe", "not a text file"),
])
def test_not_a_plan_object(tmp_path, content, reason):
    p = tmp_path / "p.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    with pytest.raises(SpecError, match=reason):
        load_plan(p)


def test_directory_is_refused(tmp_path):
    with pytest.raises(SpecError, match="is a directory"):
        load_plan(tmp_path)


@pytest.mark.parametrize("edit, field", [
    (lambda p: p.update(dp="x"), "plan.dp"),
    (lambda p: p.update(micro_batch=1.5), "plan.micro_batch"),
    (lambda p: p.update(stages=[]), "plan.stages"),
    (lambda p: p["stages"][0].update(chunks=[["a", 3]]), "plan.stages\\[0\\].chunks"),
    (lambda p: p["links"][0].update(connections=0), "plan.links\\[0\\].connections"),
    (lambda p: p.update(pipeline_offsets=[-5.0, 1.0]), "plan.pipeline_offsets"),
    (lambda p: p.update(pipeline_offsets=[0.0, float("inf")]), "plan.pipeline_offsets"),
    (lambda p: p.update(bogus=1), "plan"),
])
def test_bad_fields_name_the_field(good, tmp_path, edit, field):
    with pytest.raises(SpecError, match=field):
        load_plan(_edit(good, tmp_path, edit))


def test_cli_prints_one_line(good, tmp_path, capsys):
    from geotrain.cli import main

    bad = tmp_path / "list.json"
    bad.write_text("[1]")
    rc = main(["simulate", "examples/tiny_2dc.toml", "--plan", str(bad), "--out", str(tmp_path / "o"),
               "--no-compare"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not a geotrain plan file" in err[0]


@pytest.mark.parametrize("envelope, field, reason", [
    ({"format": "geotrain-plan/1"}, "format", "a version-1 plan file"),
    ({"version": 3}, "version", "reads version 2"),
    ({"version": None}, "version", "reads version 2"),
    ({"format": "someone-elses-plan"}, "format", "not a geotrain plan file"),
    ({"resolved_spec": [1]}, "resolved_spec", "valid dictionary"),
])
def test_old_or_foreign_plan_files_are_one_line_errors(good, tmp_path, capsys, envelope, field, reason):
    from geotrain.cli import main

    doc = {**json.loads(good.read_text()), **envelope}
    p = tmp_path / "other.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match=reason) as e:
        load_plan(p)
    assert e.value.field == field
    assert main(["simulate", str(p), "--out", str(tmp_path / "o"), "--no-compare"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0], err


def test_an_embedded_spec_is_validated_like_a_toml_one(good, tmp_path):
    from geotrain.layout.plan import plan_spec

    doc = json.loads(good.read_text())
    doc["resolved_spec"]["job"]["micro_batch"] = 0
    p = tmp_path / "bad_spec.json"
    p.write_text(json.dumps(doc))
    _, loaded = load_plan(p)
    with pytest.raises(SpecError, match="resolved_spec.job.micro_batch"):
        plan_spec(loaded, p)
