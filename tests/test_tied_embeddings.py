"""A tied Hugging Face checkpoint (tie_word_embeddings) trains tied and exports tied.

pp=2 x dp=2 under zero3: the first stage's embedding and the last stage's head are copies whose
gradients are summed every step (`runtime.tied`), so after training they are bit-equal and equal
the one matrix a pp=1 run trains (within fp tolerance: another order of additions); the export
writes tie_word_embeddings=true and no lm_head, and transformers reloads it (warnings as errors)
with geotrain's logits. The cost model counts the matrix once on a stage that holds both ends.
"""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from geotrain.config.model import ModelSpec
from geotrain.cost.model import CostModel
from geotrain.runtime.export import checkpoint_model_tensors, latest_checkpoint

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).parents[1]
LAYERS = 2
EMB, HEAD = "units.0.tok.weight", f"units.{LAYERS + 1}.out.weight"


def _geotrain(*argv):
    return subprocess.run([sys.executable, "-m", "geotrain", *argv], capture_output=True, text=True, timeout=300)


def _train(tmp_path: Path, name: str, pp: int, dp: int, sharding: str) -> tuple[Path, dict]:
    spec = tmp_path / f"{name}.toml"
    spec.write_text(f'cluster = "{ROOT / "examples/clusters/tiny_2dc.toml"}"\n'
                    'model = { hf = "hf", seq_len = 32 }\n[job]\nglobal_batch = 4\nmicro_batch = 2\n'
                    f'precision = "fp32"\nsharding = "{sharding}"\nschedule = "gpipe"\npp = {pp}\ndp = {dp}\n'
                    'steps = 3\nlr = 1e-2\ncheckpoint_every = 3\n')
    run = tmp_path / name
    r = _geotrain("train", str(spec), "--out", str(run), "--wan", "off", "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    return run, checkpoint_model_tensors(latest_checkpoint(run))


@pytest.mark.slow
def test_a_tied_checkpoint_trains_tied_across_stages_and_exports_tied(tmp_path):
    from test_hf_models import make_hf_dir

    ref = make_hf_dir(tmp_path / "hf", "mha-tied", layers=LAYERS)
    run, pp2 = _train(tmp_path, "pp2", pp=2, dp=2, sharding="zero3")
    run1, pp1 = _train(tmp_path, "pp1", pp=1, dp=1, sharding="replicate")
    import torch.distributed.checkpoint as dcp

    # pp=1 holds one Parameter; its optimizer state is saved under the head's name too, so a
    # pipeline resumed from it starts both copies with the same Adam moments.
    saved = dcp.FileSystemReader(str(latest_checkpoint(run1))).read_metadata().state_dict_metadata
    assert f"optim.state.{HEAD}.exp_avg" in saved and f"optim.state.{EMB}.exp_avg" in saved
    assert torch.equal(pp2[EMB], pp2[HEAD])               # the two stages' copies stayed bit-equal
    assert not torch.allclose(pp2[EMB], ref.model.embed_tokens.weight.detach(), atol=1e-3)   # and trained
    for name, t in pp1.items():                           # = the one matrix (and all else) of a pp=1 run
        torch.testing.assert_close(pp2[name], t, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pp2[HEAD], pp1[EMB], rtol=1e-4, atol=1e-5)

    out = tmp_path / "export"
    r = _geotrain("export", str(run), "--hf", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # noqa: SIM118 -- safe_open has no __iter__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    from geotrain.config.load import load_spec
    from geotrain.models.llama import build_model

    model = build_model(load_spec(tmp_path / "pp2.toml").model).eval()
    model.load_state_dict(pp2)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def test_the_cost_model_counts_a_tied_matrix_once_per_stage_that_holds_it():
    shape = dict(layers=2, hidden=32, heads=4, kv_heads=4, ffn=48, vocab=300, seq_len=32)
    untied, tied = CostModel(ModelSpec(**shape)), CostModel(ModelSpec(**shape, tie_embeddings=True))
    whole, first, last = range(0, 4), range(0, 2), range(2, 4)
    assert tied.stage_params(whole) == untied.stage_params(whole) - 300 * 32
    assert tied.stage_params(first) == untied.stage_params(first)     # a pipeline: a copy on each end
    assert tied.stage_params(last) == untied.stage_params(last)
    assert tied.grad_bytes(whole) == untied.grad_bytes(whole) - 2 * 300 * 32
