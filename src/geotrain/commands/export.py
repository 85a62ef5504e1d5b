"""geotrain export RUN_DIR --hf OUT: a trained run's latest checkpoint as a Hugging Face directory."""

from __future__ import annotations

import argparse

HELP = "write a training run's latest checkpoint as a Hugging Face Llama directory (--hf OUT)"
ORDER = 55


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `geotrain train` (with a checkpoint)")
    p.add_argument("--hf", required=True, metavar="OUT", help="output directory (config.json + model.safetensors)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from geotrain.config.load import load_spec
    from geotrain.errors import GeotrainError
    from geotrain.plan.plan import load_plan
    from geotrain.runtime.export import export_hf

    run_dir = Path(args.run_dir)
    if not (run_dir / "plan.json").is_file():
        raise GeotrainError(f"{run_dir}: not a training run directory (no plan.json)")
    _, doc = load_plan(run_dir / "plan.json")
    if not doc.get("spec"):
        raise GeotrainError(f"{run_dir / 'plan.json'}: does not name the experiment spec it was trained from")
    model = load_spec(doc["spec"]).model
    out = export_hf(run_dir, args.hf, model, tokenizer_dir=model.hf)
    print(f"wrote {out}/config.json and model.safetensors ({model.name}: {model.layers} layers, "
          f"{model.param_count() / 1e6:.2f} M parameters)")
    return 0
