"""Train from a tied Hugging Face directory with pp=2 x dp=2 (FSDP2 shards) and pp=1, export, reload."""

import json
from pathlib import Path

import pytest
import torch
from _cli import geotrain

from geotrain.data import open_batches
from geotrain.models.llama import build_model
from geotrain.runtime.hf_export import checkpoint_model_tensors, latest_checkpoint
from geotrain.runtime.interpreter import lm_loss

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).parents[1]


def _geotrain(capfd, *argv) -> tuple[int, str]:
    rc, out, err = geotrain(capfd, *argv)
    return rc, out + err


LAYERS = 2
EMB, HEAD = "units.0.tok.weight", f"units.{LAYERS + 1}.out.weight"


def _train(tmp_path: Path, capfd, name: str, pp: int, dp: int, sharding: str) -> Path:
    spec = tmp_path / f"{name}.toml"
    spec.write_text(f'cluster = "{ROOT / "examples/clusters/tiny_2dc.toml"}"\n'
                    'model = { hf = "hf", seq_len = 32 }\n[job]\nglobal_batch = 8\nmicro_batch = 2\n'
                    f'precision = "fp32"\nsharding = "{sharding}"\nschedule = "1f1b"\npp = {pp}\ndp = {dp}\n'
                    'steps = 3\nlr = 1e-2\ncheckpoint_every = 3\n')
    run = tmp_path / name
    rc, log = _geotrain(capfd, "train", str(spec), "--out", str(run), "--wan", "off", "--no-progress")
    assert rc == 0, log
    (run / "cli.log").write_text(log)
    return run


@pytest.mark.slow
def test_train_tied_hf_pp2_dp2_then_export_reloads_tied_with_equal_logits(tmp_path, capfd):
    """A tied checkpoint (tie_word_embeddings) trains tied: pp=2 x dp=2 under zero3, the first
    stage's embedding and the last stage's head are copies whose gradients are summed every step
    (`runtime.tied`), so after training they are bit-equal and equal the one matrix a pp=1 run
    trains (within fp tolerance: another order of additions); the export writes
    tie_word_embeddings=true and no lm_head, and transformers reloads it (warnings as errors) with
    geotrain's logits."""
    from test_hf_models import make_hf_dir

    ref = make_hf_dir(tmp_path / "hf", "mha-tied", layers=LAYERS)
    run = _train(tmp_path, capfd, "pp2", pp=2, dp=2, sharding="zero3")
    # The two copies sit in two DCs: the start-up log says how their gradients cross the WAN.
    logs = [run / "cli.log", *sorted((run / "logs").glob("rank*.log"))]
    said = [ln for f in logs for ln in f.read_text().splitlines() if "geotrain wan: tied embeddings" in ln]
    assert len(said) == 1 and "east" in said[0] and "west" in said[0], said
    # Step 1 trained the HF weights: its loss is transformers' loss on the same global batch.
    first = json.loads((run / "losses.jsonl").read_text().splitlines()[0])
    x, y = open_batches(None, seq_len=32, global_batch=8, dp=2, micro_batch=2, seed=0).global_batch(0)
    loss = lm_loss(ref(x).logits, y)
    loss.backward()
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()   # the tied matrix counted once
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert first["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
    pp2 = checkpoint_model_tensors(latest_checkpoint(run))
    assert torch.equal(pp2[EMB], pp2[HEAD])               # the two stages' copies stayed bit-equal
    assert not torch.allclose(pp2[EMB], ref.model.embed_tokens.weight.detach(), atol=1e-3)   # and trained

    run1 = _train(tmp_path, capfd, "pp1", pp=1, dp=1, sharding="replicate")
    pp1 = checkpoint_model_tensors(latest_checkpoint(run1))
    # pp=1 holds both ends as one Parameter: its norm counts the matrix once too (it was two copies
    # after materialising, counted twice: 3.28 against 2.40, so clipping scaled pp=1 differently).
    assert json.loads((run1 / "losses.jsonl").read_text().splitlines()[0])["grad_norm"] == \
        pytest.approx(want_norm, rel=1e-5)
    for name, t in pp1.items():                           # = the one matrix (and all else) of a pp=1 run
        torch.testing.assert_close(pp2[name], t, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pp2[HEAD], pp1[EMB], rtol=1e-4, atol=1e-5)
    # pp=1 holds one Parameter; its optimizer state is saved under the head's name too, so a
    # pipeline resumed from it starts both copies with the same Adam moments.
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(latest_checkpoint(run1))).read_metadata().state_dict_metadata
    assert f"optim.state.{HEAD}.exp_avg" in saved and f"optim.state.{EMB}.exp_avg" in saved

    out = tmp_path / "export"
    rc, log = _geotrain(capfd, "export", str(run), "--hf", str(out))
    assert rc == 0, log
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # noqa: SIM118 -- safe_open has no __iter__
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    # geotrain's own model from the checkpoint's tensors (by geotrain's names) gives the same logits.
    from geotrain.spec.load import load_spec

    model = build_model(load_spec(tmp_path / "pp2.toml").model).eval()
    model.load_state_dict(pp2)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(hf(tokens).logits, ref(tokens).logits, atol=1e-4)   # it did train


def test_an_untied_checkpoint_exports_untied(tmp_path):
    """The export of an untied model (from a one-process DCP checkpoint of its HF weights): its
    own lm_head, tie_word_embeddings=false, transformers' logits equal the source's."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from test_hf_models import make_hf_dir

    from geotrain.models.hf_weights import load_hf_weights
    from geotrain.runtime.hf_export import export_hf
    from geotrain.spec.load import load_model

    ref = make_hf_dir(tmp_path / "hf", "gqa-untied", layers=LAYERS)
    spec = load_model(tmp_path / "hf")
    model = build_model(spec)
    load_hf_weights(model, spec.hf, spec.tie_embeddings)
    root = tmp_path / "run" / "checkpoints"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)    # "torch.distributed is uninitialized": one process
        dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(root / "step_00000001"), no_dist=True)
    (root / "latest").write_text("step_00000001\n")
    out = export_hf(tmp_path / "run", tmp_path / "out", spec)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ref(tokens).logits, rtol=1e-5, atol=1e-5)


def test_export_without_checkpoint_is_one_line(tmp_path, capsys):
    from geotrain.cli import main

    (tmp_path / "run").mkdir()
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "o")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_export_never_replaces_a_directory_it_did_not_write(tmp_path, capsys):
    from geotrain.models.presets import PRESETS
    from geotrain.runtime.hf_export import export_hf

    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    with pytest.raises(Exception, match="holds notes.txt"):
        export_hf(tmp_path / "run", keep, PRESETS["tiny"])
    assert (keep / "notes.txt").read_text() == "precious"
