import json
import re

from geotrain.bubbletea.prefill_cost import inference_memory_bytes
from geotrain.cli import main
from geotrain.models.presets import PRESETS


def test_simulate_with_bubbletea_reports_and_draws(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "examples/tiny_2dc.toml", "--out", str(out), "--no-compare", "--no-progress",
               "--bubbletea", "inference_model=tiny,mean_prompt=64,min_chunk=4,iterations=10"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "GPU utilization with BubbleTea" in text and "training actions moved" in text
    doc = json.loads((out / "bubbletea.json").read_text())
    assert doc["utilization_with"] > doc["utilization_without"]
    assert (out / "bubbletea_timeline.png").stat().st_size > 10_000


def test_bad_workload_is_one_line_exit_2(tmp_path, capsys):
    rc = main(["simulate", "examples/tiny_2dc.toml", "--out", str(tmp_path), "--no-compare",
               "--bubbletea", "rate=fast"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "rate" in err


def test_plan_reports_bubbletea_headroom_and_models_that_fit(capsys):
    assert main(["plan", "examples/llama2_7b_a100_3dc.toml", "--top-k", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "BubbleTea:" in x)
    # The free memory is the tightest GPU's beside the plan's peak (docs/MEMORY.md); the list is every preset
    # whose weights, KV cache of a full prompt and one chunk's activations fit there -- and no other.
    free_gib = float(re.search(r"([\d.]+) GiB free beside training", line).group(1))
    listed = [n.strip() for n in line.split("fit:")[1].split(",")]
    assert "tiny" in listed and "small" in listed
    need = {n: inference_memory_bytes(m, m.seq_len) / 2**30 for n, m in PRESETS.items()}
    assert set(listed) == {n for n, g in need.items() if g <= free_gib + 0.05}, (free_gib, need)
    assert "llama2-70b" not in listed                  # 140 GB of weights never fit an 80 GB GPU
