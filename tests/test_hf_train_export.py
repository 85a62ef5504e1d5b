"""Train from a Hugging Face directory with pp=2 x dp=2 (FSDP2 shards), export, reload in transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geotrain.data import open_batches
from geotrain.models.llama import build_model
from geotrain.runtime.export import checkpoint_model_tensors, latest_checkpoint
from geotrain.runtime.pipeline import lm_loss

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).parents[1]


def _geotrain(*argv):
    return subprocess.run([sys.executable, "-m", "geotrain", *argv], capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_train_from_hf_pp2_dp2_then_export_reloads_with_equal_logits(tmp_path):
    from test_hf_models import make_hf_dir

    ref = make_hf_dir(tmp_path / "hf", "gqa-untied", layers=2)
    spec = tmp_path / "exp.toml"
    spec.write_text(f'cluster = "{ROOT / "examples/clusters/tiny_2dc.toml"}"\n'
                    'model = { hf = "hf", seq_len = 32 }\n[job]\nglobal_batch = 8\nmicro_batch = 2\n'
                    'precision = "fp32"\nsharding = "zero3"\nschedule = "1f1b"\npp = 2\ndp = 2\nsteps = 3\n'
                    'lr = 1e-3\ncheckpoint_every = 3\n')
    run = tmp_path / "run"
    r = _geotrain("train", str(spec), "--out", str(run), "--wan", "off", "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    # Step 1 trained the HF weights: its loss is transformers' loss on the same global batch.
    first = json.loads((run / "losses.jsonl").read_text().splitlines()[0])["loss"]
    x, y = open_batches(None, seq_len=32, global_batch=8, dp=2, micro_batch=2, seed=0).global_batch(0)
    with torch.no_grad():
        want = lm_loss(ref(x).logits, y).item()
    assert first == pytest.approx(want, rel=1e-5)

    out = tmp_path / "export"
    r = _geotrain("export", str(run), "--hf", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    # geotrain's own model from the checkpoint's tensors (by geotrain's names) gives the same logits.
    from geotrain.config.load import load_spec

    model = build_model(load_spec(spec).model).eval()
    model.load_state_dict(checkpoint_model_tensors(latest_checkpoint(run)))
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(hf(tokens).logits, ref(tokens).logits, atol=1e-4)   # it did train


def test_export_without_checkpoint_is_one_line(tmp_path, capsys):
    from geotrain.cli import main

    (tmp_path / "run").mkdir()
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "o")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_export_never_replaces_a_directory_it_did_not_write(tmp_path, capsys):
    from geotrain.models.presets import PRESETS
    from geotrain.runtime.export import export_hf

    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(Exception, match="holds notes.txt"):
        export_hf(tmp_path / "run", keep, PRESETS["tiny"])
    assert (keep / "notes.txt").read_text() == "precious"
