"""Spec validation: every bad input gives one line naming file, field and reason, exit 2.

Each case starts from a valid experiment (experiment.toml -> cluster.toml + a preset) written into
tmp_path, breaks one thing, and runs the real CLI entry point on it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geotrain.cli import main
from geotrain.spec import Cluster, JobSpec, WanLink, load_spec

CLUSTER = """\
name = "c"

[[datacenters]]
name = "east"
gpu_type = "a100-80g"
gpus = 16

[[datacenters]]
name = "west"
gpu_type = "a100-80g"
gpus = 16

[[wan_links]]
between = ["east", "west"]
latency_ms = 20
capacity_gbps = 100
per_connection_gbps = 2
"""

EXPERIMENT = """\
name = "e"
cluster = "cluster.toml"
model = "small"

[job]
global_batch = 32
micro_batch = 4
"""

MODEL = """\
name = "m"
layers = 4
hidden = 64
heads = 4
kv_heads = 2
ffn = 172
vocab = 256
seq_len = 64
"""

GPU_TYPE = "[gpu_types.mine]\nbf16_tflops = 100\nfp16_tflops = 100\nfp32_tflops = 10\nmemory_gib = 40"
DCS = "\n\n[[datacenters]]"


def write_specs(tmp_path: Path, edits: dict[str, tuple[str, str]] | None = None) -> None:
    files = {"cluster.toml": CLUSTER, "experiment.toml": EXPERIMENT, "model.toml": MODEL}
    for name, (old, new) in (edits or {}).items():
        assert old in files[name], f"test bug: {old!r} not in {name}"
        files[name] = files[name].replace(old, new, 1)
    for name, text in files.items():
        (tmp_path / name).write_text(text)


def validate_err(capsys: pytest.CaptureFixture[str], path: Path | str) -> str:
    rc = main(["validate", str(path)])
    out = capsys.readouterr()
    assert rc == 2, out
    assert "Traceback" not in out.err + out.out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


# (id, file edited, old text, new text, file named in the error, field, reason)
BAD = [
    ("experiment-unknown-key", "experiment.toml", 'name = "e"', 'colour = "red"\nname = "e"',
     "experiment.toml", "colour", "unknown key"),
    ("job-unknown-key", "experiment.toml", "micro_batch = 4", "micro_bach = 4",
     "experiment.toml", "job.micro_bach", "unknown key"),
    ("cluster-unknown-key", "cluster.toml", 'name = "c"', 'region = "x"\nname = "c"',
     "cluster.toml", "region", "unknown key"),
    ("dc-unknown-key", "cluster.toml", "gpus = 16", "gpus = 16\ngpu_count = 16",
     "cluster.toml", "datacenters[0].gpu_count", "unknown key"),
    ("link-unknown-key", "cluster.toml", "capacity_gbps = 100", "capacity_gbps = 100\nbandwidth = 3",
     "cluster.toml", "wan_links[0].bandwidth", "unknown key"),
    ("job-missing-global-batch", "experiment.toml", "global_batch = 32\n", "",
     "experiment.toml", "job.global_batch", "required field is missing"),
    ("dc-missing-gpus", "cluster.toml", "gpus = 16\n", "",
     "cluster.toml", "datacenters[0].gpus", "required field is missing"),
    ("link-missing-capacity", "cluster.toml", "capacity_gbps = 100\n", "",
     "cluster.toml", "wan_links[0].capacity_gbps", "required field is missing"),
    ("experiment-missing-cluster", "experiment.toml", 'cluster = "cluster.toml"\n', "",
     "experiment.toml", "cluster", "required field is missing"),
    ("zero-capacity", "cluster.toml", "capacity_gbps = 100", "capacity_gbps = 0",
     "cluster.toml", "wan_links[0].capacity_gbps", "greater than 0"),
    ("negative-per-connection", "cluster.toml", "per_connection_gbps = 2", "per_connection_gbps = -2",
     "cluster.toml", "wan_links[0].per_connection_gbps", "greater than 0"),
    ("zero-intra-dc-bandwidth", "cluster.toml", "gpus = 16", "gpus = 16\nintra_dc_gbps = 0",
     "cluster.toml", "datacenters[0].intra_dc_gbps", "greater than 0"),
    ("zero-gpus", "cluster.toml", "gpus = 16", "gpus = 0",
     "cluster.toml", "datacenters[0].gpus", "greater than 0"),
    ("negative-latency", "cluster.toml", "latency_ms = 20", "latency_ms = -5",
     "cluster.toml", "wan_links[0].latency_ms", "greater than 0"),
    ("nan-capacity", "cluster.toml", "capacity_gbps = 100", "capacity_gbps = nan",
     "cluster.toml", "wan_links[0].capacity_gbps", "finite"),
    ("loss-above-one", "cluster.toml", "capacity_gbps = 100", "capacity_gbps = 100\nloss = 1.5",
     "cluster.toml", "wan_links[0].loss", "less than 1"),
    ("link-to-unknown-dc", "cluster.toml", '["east", "west"]', '["east", "mars"]',
     "cluster.toml", "wan_links[0].between", "unknown datacenter 'mars'"),
    ("link-to-itself", "cluster.toml", '["east", "west"]', '["east", "east"]',
     "cluster.toml", "wan_links[0].between", "two different datacenters"),
    ("link-three-ends", "cluster.toml", '["east", "west"]', '["east", "west", "east"]',
     "cluster.toml", "wan_links[0].between", "at most 2"),
    ("duplicate-dc", "cluster.toml", 'name = "west"', 'name = "east"',
     "cluster.toml", "datacenters[1].name", "duplicate datacenter name 'east'"),
    ("unknown-gpu-type", "cluster.toml", 'gpu_type = "a100-80g"', 'gpu_type = "b300"',
     "cluster.toml", "datacenters[0].gpu_type", "unknown GPU type 'b300'"),
    ("string-for-int", "cluster.toml", "gpus = 16", 'gpus = "fast"',
     "cluster.toml", "datacenters[0].gpus", "valid integer"),
    ("string-for-float", "cluster.toml", "latency_ms = 20", 'latency_ms = "fast"',
     "cluster.toml", "wan_links[0].latency_ms", "valid number"),
    ("bool-for-int", "cluster.toml", "gpus = 16", "gpus = true",
     "cluster.toml", "datacenters[0].gpus", "valid integer"),
    ("float-for-int", "experiment.toml", "global_batch = 32", "global_batch = 32.5",
     "experiment.toml", "job.global_batch", "valid integer"),
    ("table-not-list", "cluster.toml", "[[wan_links]]", "[wan_links]",
     "cluster.toml", "wan_links", "valid list"),
    ("micro-batch-word", "experiment.toml", "micro_batch = 4", 'micro_batch = "fast"',
     "experiment.toml", "job.micro_batch", 'positive integer or "auto"'),
    ("bad-precision", "experiment.toml", "micro_batch = 4", 'micro_batch = 4\nprecision = "fp8"',
     "experiment.toml", "job.precision", "'fp32', 'bf16' or 'fp16'"),
    ("bad-sharding", "experiment.toml", "micro_batch = 4", 'micro_batch = 4\nsharding = "zero9"',
     "experiment.toml", "job.sharding", "'zero3' or 'auto'"),
    ("micro-batch-above-global", "experiment.toml", "micro_batch = 4", "micro_batch = 64",
     "experiment.toml", "job.micro_batch", "larger than global_batch=32"),
    ("micro-batch-not-dividing", "experiment.toml", "micro_batch = 4", "micro_batch = 5",
     "experiment.toml", "job.micro_batch", "not a multiple of micro_batch=5"),
    ("dp-not-dividing", "experiment.toml", "micro_batch = 4", "micro_batch = 4\ndp = 3",
     "experiment.toml", "job.dp", "not a multiple of dp=3"),
    ("pp-above-units", "experiment.toml", "micro_batch = 4", "micro_batch = 4\npp = 9",
     "experiment.toml", "job.pp", "only 8 units"),
    ("tp-not-dividing-heads", "experiment.toml", "micro_batch = 4", "micro_batch = 4\ntp = 4",
     "experiment.toml", "job.tp", "must divide heads=6"),
    ("more-gpus-than-cluster", "experiment.toml", "micro_batch = 4", "micro_batch = 1\npp = 2\ndp = 32",
     "experiment.toml", "job", "64 GPUs but the cluster has 32"),
    ("missing-data-path", "experiment.toml", "micro_batch = 4", 'micro_batch = 4\ndata = "corpus/"',
     "experiment.toml", "job.data", "no such file or directory: corpus/"),
    ("custom-gpu-zero-memory", "cluster.toml", "[[datacenters]]", GPU_TYPE.replace("= 40", "= 0") + DCS,
     "cluster.toml", "gpu_types.mine.memory_gib", "greater than 0"),
    ("custom-gpu-unknown-key", "cluster.toml", "[[datacenters]]", GPU_TYPE + "\nhbm_gib = 40" + DCS,
     "cluster.toml", "gpu_types.mine.hbm_gib", "unknown key"),
    ("custom-gpu-efficiency-above-one", "cluster.toml", "[[datacenters]]", GPU_TYPE + "\nefficiency = 1.5" + DCS,
     "cluster.toml", "gpu_types.mine.efficiency", "less than or equal to 1"),
    ("malformed-toml", "cluster.toml", "gpus = 16", "gpus = = 16",
     "cluster.toml", "line 6", "not valid TOML"),
    ("missing-cluster-file", "experiment.toml", '"cluster.toml"', '"nowhere.toml"',
     "experiment.toml", "cluster", "file not found"),
    ("unknown-model-preset", "experiment.toml", 'model = "small"', 'model = "llama9"',
     "experiment.toml", "model", "neither a model preset"),
    ("model-file-unknown-preset", "model.toml", 'name = "m"', 'preset = "gpt5"',
     "model.toml", "preset", "unknown model preset 'gpt5'"),
    ("model-file-unknown-key", "model.toml", "vocab = 256", "vocab = 256\nvocabulary = 3",
     "model.toml", "vocabulary", "unknown key"),
    ("model-file-bad-heads", "model.toml", "heads = 4", "heads = 5",
     "model.toml", "hidden", "not divisible by heads=5"),
    ("model-does-not-fit", "experiment.toml", 'model = "small"', 'model = "gpt3-175b"',
     "experiment.toml", "model", "cannot fit"),
    # Names others refer to are identifiers (issue #30): these were distinct DCs, or echoed raw.
    ("dc-name-trailing-space", "cluster.toml", 'name = "west"', 'name = "east "',
     "cluster.toml", "datacenters[1].name", "'east ' has leading or trailing white space"),
    ("dc-name-cyrillic", "cluster.toml", 'name = "west"', 'name = "\u0435ast"',
     "cluster.toml", "datacenters[1].name", "non-ASCII character"),
    ("dc-name-nfd", "cluster.toml", 'name = "west"', 'name = "we\u0301st"',
     "cluster.toml", "datacenters[1].name", "non-ASCII character"),
    ("dc-name-control", "cluster.toml", 'name = "west"', 'name = "we\\u001b[2Jst"',
     "cluster.toml", "datacenters[1].name", "'we\\x1b[2Jst' has a control or invisible character"),
    ("dc-name-slash", "cluster.toml", 'name = "west"', 'name = "we/st"',
     "cluster.toml", "datacenters[1].name", "may hold only letters, digits"),
    ("experiment-name-newline", "experiment.toml", 'name = "e"', 'name = "e\\nx"',
     "experiment.toml", "name", "control or invisible character"),
    ("zero-latency", "cluster.toml", "latency_ms = 20", "latency_ms = 0",
     "cluster.toml", "wan_links[0].latency_ms", "greater than 0"),
    ("loss-one", "cluster.toml", "capacity_gbps = 100", "capacity_gbps = 100\nloss = 1.0",
     "cluster.toml", "wan_links[0].loss", "less than 1"),
    ("custom-gpu-efficiency-subnormal", "cluster.toml", "[[datacenters]]", GPU_TYPE + "\nefficiency = 5e-324" + DCS,
     "cluster.toml", "gpu_types.mine.efficiency", "at least 0.001"),
]


@pytest.mark.parametrize(("edit_file", "old", "new", "err_file", "field", "reason"),
                         [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_spec_gives_one_line(tmp_path, capsys, edit_file, old, new, err_file, field, reason):
    write_specs(tmp_path, {edit_file: (old, new)})
    # Model files stand alone; every other case goes through the experiment that uses cluster.toml.
    target = tmp_path / ("model.toml" if edit_file == "model.toml" else "experiment.toml")
    line = validate_err(capsys, target)
    assert f"{tmp_path / err_file}: {field}: " in line, line
    assert reason in line, line


def test_cluster_file_alone_reports_its_own_error(tmp_path, capsys):
    write_specs(tmp_path, {"cluster.toml": ("capacity_gbps = 100", "capacity_gbps = -1")})
    line = validate_err(capsys, tmp_path / "cluster.toml")
    assert f"{tmp_path / 'cluster.toml'}: wan_links[0].capacity_gbps: " in line
    assert "greater than 0 (got -1)" in line


def test_inline_cluster_error_is_prefixed(tmp_path, capsys):
    write_specs(tmp_path)
    exp = tmp_path / "inline.toml"
    exp.write_text(EXPERIMENT.replace('cluster = "cluster.toml"\n', "")
                   + "\n[cluster]\n[[cluster.datacenters]]\nname = \"a\"\ngpu_type = \"cpu\"\ngpus = -3\n")
    line = validate_err(capsys, exp)
    assert f"{exp}: cluster.datacenters[0].gpus: " in line and "greater than 0" in line


def test_inline_model_error_is_prefixed(tmp_path, capsys):
    write_specs(tmp_path)
    exp = tmp_path / "inline.toml"
    exp.write_text(EXPERIMENT.replace('model = "small"\n', "")
                   + '\n[model]\npreset = "tiny"\nheads = 3\n')
    line = validate_err(capsys, exp)
    assert f"{exp}: model.hidden: " in line and "not divisible by heads=3" in line


def test_file_not_found(tmp_path, capsys):
    missing = tmp_path / "absent.toml"
    line = validate_err(capsys, missing)
    assert str(missing) in line and "file not found" in line


def test_directory_instead_of_file(tmp_path, capsys):
    line = validate_err(capsys, tmp_path)
    assert str(tmp_path) in line and "directory" in line


def test_unrecognised_file_kind(tmp_path, capsys):
    f = tmp_path / "what.toml"
    f.write_text("colour = 1\n")
    line = validate_err(capsys, f)
    assert f"{f}: (top level): " in line and "not a cluster" in line


def test_valid_files_pass_and_one_bad_file_fails_the_run(tmp_path, capsys):
    write_specs(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text(EXPERIMENT.replace("micro_batch = 4", "micro_batch = 0"))
    paths = [tmp_path / n for n in ("experiment.toml", "cluster.toml", "model.toml")]
    assert main(["validate", *map(str, paths)]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out.count("ok  ") == 3
    assert main(["validate", *map(str, paths), str(bad)]) == 2
    out = capsys.readouterr()
    assert out.out.count("ok  ") == 3 and len(out.err.strip().splitlines()) == 1 and str(bad) in out.err


def test_loaded_spec_has_typed_values(tmp_path):
    write_specs(tmp_path)
    spec = load_spec(tmp_path / "experiment.toml")
    assert spec.cluster.total_gpus == 32 and spec.model.name == "small" and spec.job.micro_batch == 4
    assert spec.cluster.link("west", "east") is spec.cluster.link("east", "west") is not None
    assert spec.cluster.dc("west").gpus == 16 and spec.cluster.gpu("a100-80g").memory_gib == 80


def test_wan_link_rate_grows_with_connections_up_to_capacity():
    link = WanLink(between=["a", "b"], latency_ms=30, capacity_gbps=10, per_connection_gbps=3, max_connections=64)
    assert [link.rate_gbps(n) for n in (1, 2, 3, 4, 100)] == [3, 6, 9, 10, 10]
    assert link.connections_to_saturate() == 4
    capped = link.model_copy(update={"max_connections": 2})
    assert capped.rate_gbps(8) == 6 and capped.connections_to_saturate() == 2


def test_specs_are_frozen_and_fsdp_is_an_alias():
    job = JobSpec.model_validate({"global_batch": 8, "sharding": "fsdp"})
    assert job.sharding == "zero3"
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        job.global_batch = 4  # type: ignore[misc]
    c = Cluster.model_validate({"datacenters": [{"name": "a", "gpu_type": "cpu", "gpus": 2}]})
    assert c.link("a", "b") is None


def test_data_path_is_resolved_against_the_spec(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("hello")
    for value in ("stdlib", "corpus.txt", str(tmp_path / "corpus.txt")):
        write_specs(tmp_path, {"experiment.toml": ("micro_batch = 4", f'micro_batch = 4\ndata = "{value}"')})
        assert main(["validate", str(tmp_path / "experiment.toml")]) == 0, capsys.readouterr().err
        assert load_spec(tmp_path / "experiment.toml").job.data == value


def test_a_reader_that_leaves_early_gets_no_traceback_and_the_plan_is_kept(tmp_path):
    """`geotrain plan SPEC --out P | head -1`: the pipe closes under the plan's printing."""
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    p = subprocess.Popen([sys.executable, "-m", "geotrain", "plan", "examples/tiny_2dc.toml", "--compare",
                          "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()                       # like `head -1` exiting
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err, err
    assert p.returncode in (0, 141)
    assert out.exists()


def test_a_model_that_cannot_fit_even_fully_sharded_is_refused(tmp_path, capsys):
    """gpt3-175b's training state (16 B/param, ~2.8 TB) on 32 x 80 GiB (2.5 TiB): refused at load time."""
    write_specs(tmp_path, {"experiment.toml": ('model = "small"', 'model = "gpt3-175b"')})
    line = validate_err(capsys, tmp_path / "experiment.toml")
    assert "experiment.toml: model: gpt3-175b needs" in line and "cannot fit even fully sharded" in line
    write_specs(tmp_path, {"experiment.toml": ('model = "small"', 'model = "llama2-70b"')})
    assert main(["validate", str(tmp_path / "experiment.toml")]) == 0


def test_presets_are_the_model_packages_shapes(tmp_path):
    """A preset named in a spec is validated into a ModelSpec equal, field by field, to the model
    package's own shape of it (one table of presets, read by both)."""
    from geotrain.models.presets import PRESETS

    write_specs(tmp_path)
    spec = load_spec(tmp_path / "experiment.toml")
    assert spec.model.shape == PRESETS["small"]
    weights = {"hf", "tie_embeddings", "allow_missing", "bos_token_id", "eos_token_id", "pad_token_id"}
    assert spec.model.model_dump(exclude=weights) == PRESETS["small"].fields_dict()
    assert spec.model.param_count() == PRESETS["small"].param_count()


def test_pp_and_dp_auto_are_the_planners_choice():
    """The README: "auto" leaves a choice to the planner -- pp and dp too (they were refused)."""
    job = JobSpec(global_batch=8, pp="auto", dp="auto")
    assert job.pp is None and job.dp is None
    assert JobSpec(global_batch=8, pp=2).pp == 2
    with pytest.raises(ValueError):
        JobSpec(global_batch=8, pp="deep")
