"""Which model BubbleTea serves: a preset (freshly initialised, for tests and planning) or a
Hugging Face Llama directory (config.json + safetensors, and its tokenizer.json when it has one)
-- for instance one `geotrain export` wrote from a training run.

The service (decoding) and every training rank (prefill in the bubbles) load the same model from
the same reference, so a KV cache computed on a rank continues correctly on the decode worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geotrain.errors import GeotrainError, SpecError
from geotrain.models.presets import PRESETS
from geotrain.spec.hf_config import is_hf_dir
from geotrain.spec.load import load_model


@dataclass
class InferenceModel:
    model: object          # models.llama.UnitStack, eval mode
    spec: object           # spec.model.ModelSpec
    tokenizer: object      # data.tokenizer.ByteTokenizer or HFTokenizer
    name: str              # what /v1/models lists


def describe_ref(ref: str) -> str:
    """One line on what `ref` is, or a GeotrainError saying why it is not a servable model."""
    if ref in PRESETS:
        return f"preset {ref} (untrained)"
    if is_hf_dir(Path(ref)):
        return f"Hugging Face directory {ref}"
    raise GeotrainError(f"--prefill-model: {ref!r} is neither a model preset ({', '.join(PRESETS)}), a Hugging "
                        "Face directory (config.json + model.safetensors) nor a training run with a checkpoint")


def model_spec(ref: str):
    if ref in PRESETS:
        return PRESETS[ref]
    try:
        return load_model(Path(ref))
    except SpecError as e:
        raise GeotrainError(f"--prefill-model: {e}") from None


def load_inference_model(ref: str) -> InferenceModel:
    # lazy: numpy, torch, tqdm only when called (importers that never call it stay free of it)
    from geotrain.data.tokenizer import ByteTokenizer, load_tokenizer
    from geotrain.models.hf_weights import HFWeightsError, load_hf_weights
    from geotrain.models.llama import build_model

    describe_ref(ref)
    spec = model_spec(ref)
    model = build_model(spec).eval()
    if getattr(spec, "hf", None):        # presets are bare shapes: no weights to load
        try:
            load_hf_weights(model, spec.hf, spec.tie_embeddings, spec.allow_missing)
            tokenizer = load_tokenizer(spec.hf)
        except (HFWeightsError, ValueError) as e:
            raise GeotrainError(f"--prefill-model: {e}") from None
        name = Path(spec.hf).name
    else:
        tokenizer, name = ByteTokenizer(), f"geotrain-{ref}"
    if tokenizer.vocab_size > spec.vocab:
        raise GeotrainError(f"--prefill-model: the tokenizer has {tokenizer.vocab_size} tokens, the model {spec.vocab}")
    return InferenceModel(model, spec, tokenizer, name)
