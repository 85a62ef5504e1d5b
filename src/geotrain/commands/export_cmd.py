"""geotrain export RUN_DIR --hf OUT: a trained run's latest checkpoint as a Hugging Face directory."""

from __future__ import annotations

import argparse

from geotrain.runtime.hf_export import export_run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="directory written by `geotrain train` (with a checkpoint)")
    p.add_argument("--hf", required=True, metavar="OUT", help="output directory (config.json + model.safetensors)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written weights (default float32, what training keeps)")


def run(args: argparse.Namespace) -> int:
    out, model = export_run(args.run_dir, args.hf, args.dtype)
    print(f"wrote {out}/config.json and model.safetensors ({model.name}: {model.layers} layers, "
          f"{model.param_count() / 1e6:.2f} M parameters, {args.dtype})")
    return 0
