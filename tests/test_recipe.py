"""The recipe's settings: the learning-rate schedule as a pure function of the step, weight-decay
groups by kind of parameter, and [job] validation with one-line errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from geotrain.errors import SpecError
from geotrain.models.llama import build_model
from geotrain.runtime.recipe import lr_at, param_groups
from geotrain.spec.job import JobSpec
from geotrain.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]


def _job(**kw) -> JobSpec:
    return JobSpec(global_batch=8, steps=100, lr=1e-3, **kw)


def test_schedules_warm_up_then_decay_to_the_final_rate():
    cos = _job(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert [lr_at(s, cos) for s in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert lr_at(55, cos) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, cos) == pytest.approx(1e-4) and lr_at(250, cos) == pytest.approx(1e-4)   # stays after
    lin = _job(decay="linear", min_lr=0.0)
    assert lr_at(50, lin) == pytest.approx(5e-4) and lr_at(100, lin) == 0.0
    wsd = _job(warmup_steps=10, decay="wsd", wsd_decay_fraction=0.2, min_lr=1e-5)
    assert lr_at(11, wsd) == lr_at(82, wsd) == 1e-3                  # stable until the last 20 % of 90 steps
    assert lr_at(91, wsd) == pytest.approx(1e-3 - (1e-3 - 1e-5) * 0.5) and lr_at(100, wsd) == pytest.approx(1e-5)
    assert all(lr_at(s, _job(decay="constant")) == 1e-3 for s in (1, 50, 100))
    # A pure function of the step: the same at any step whatever was called before (resume, reshard).
    assert [lr_at(s, cos) for s in (70, 3, 70)] == [lr_at(70, cos), lr_at(3, cos), lr_at(70, cos)]


def test_weight_decay_on_matrices_only_unless_asked():
    tiny = load_spec(ROOT / "examples" / "tiny_2dc.toml").model
    model = build_model(tiny.model_copy(update={"tie_embeddings": True}))
    untied_head = model.units[str(tiny.num_units - 1)].out.weight
    # A pipeline's last stage holds its own copy of the tied matrix: an embedding too, never decayed.
    assert all(all(p is not untied_head for p in g["params"]) or g["weight_decay"] == 0
               for g in param_groups([model], _job(), embeddings=[untied_head]))
    model.tie_head_to_embedding()            # one chunk with both ends: one matrix (runtime.materialize)
    names = {id(p): n for n, p in model.named_parameters()}

    def decayed(job) -> set[str]:
        return {names[id(p)] for g in param_groups([model], job) if g["weight_decay"] > 0 for p in g["params"]}

    job = _job()
    got = decayed(job)
    assert got and all(n.endswith(("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w_gate.weight",
                                   "w_up.weight", "w_down.weight")) for n in got)
    assert not any("norm" in n or "tok" in n for n in got)          # norms, and the tied embedding/head
    groups = param_groups([model], job)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))   # each once
    assert any("tok" in n for n in decayed(_job(weight_decay_embeddings=True)))
    assert any("norm" in n for n in decayed(_job(weight_decay_norms=True)))


@pytest.mark.parametrize("line,field,why", [
    ("betas = [0.9, 1.0]", "job.betas", "each must be in [0, 1)"),
    ("betas = [0.9]", "job.betas", "at least 2"),
    ('decay = "exponential"', "job.decay", "cosine"),
    ("min_lr = 1e-5\nmin_lr_ratio = 0.2", "job.min_lr", "not both"),
    ("min_lr = 1.0", "job.min_lr", "above lr"),
    ("warmup_steps = 500", "job.warmup_steps", "more than steps=30"),
    ("grad_clip = -1.0", "job.grad_clip", "greater than or equal to 0"),
    ("eval_split = 0.9", "job.eval_split", "less than 0.5"),
    ("data = 5", "job.data", "must be a path"),
    ('[[job.data]]\npath = "nowhere.jsonl"', "job.data[0].path", "no such file or directory"),
    ('[[job.data]]\npath = "corpus.txt"\nweight = 0.0', "job.data[0].weight", "greater than 0"),
])
def test_bad_recipe_settings_are_one_line(tmp_path, line, field, why):
    (tmp_path / "corpus.txt").write_text("hello")
    text = (ROOT / "examples" / "tiny_2dc.toml").read_text()
    text = text.replace('cluster = "clusters/', f'cluster = "{ROOT}/examples/clusters/')
    head, tail = text.split("[bubbletea]")
    (tmp_path / "e.toml").write_text(head + line + "\n\n[bubbletea]" + tail)
    with pytest.raises(SpecError) as e:
        load_spec(tmp_path / "e.toml")
    msg = str(e.value)
    assert "\n" not in msg and f": {field}: " in msg and why in msg, msg


def test_data_sources_as_a_table_or_a_list(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "x"}\n')
    text = (ROOT / "examples" / "tiny_2dc.toml").read_text()
    text = text.replace('cluster = "clusters/', f'cluster = "{ROOT}/examples/clusters/').split("[bubbletea]")[0]
    (tmp_path / "one.toml").write_text(text + 'data = { path = "a.jsonl", field = "content" }\n')
    one = load_spec(tmp_path / "one.toml").job
    assert [(s.path, s.field, s.weight) for s in one.data_sources] == [("a.jsonl", "content", 1.0)]
    (tmp_path / "two.toml").write_text(text + '[[job.data]]\npath = "a.jsonl"\nweight = 3\nfield = "content"\n'
                                       '[[job.data]]\npath = "stdlib"\n')
    assert [s.weight for s in load_spec(tmp_path / "two.toml").job.data_sources] == [3.0, 1.0]
    assert load_spec(ROOT / "examples" / "tiny_2dc.toml").job.data_sources is None
