"""Named model shapes, from one that trains on a CPU in seconds to ones only ever planned."""

from __future__ import annotations

from geotrain.config.model import ModelSpec


def _m(name: str, **kw: int) -> ModelSpec:
    return ModelSpec(name=name, **kw)


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _m("tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn=172, vocab=256, seq_len=64),
        _m("small", layers=6, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=256, seq_len=256),
        _m("llama2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq_len=4096),
        _m("llama2-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000, seq_len=4096),
        _m("llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq_len=4096),
        # GPT-3 175B's shape with a SwiGLU MLP sized (2/3 * 4h) to keep ~175B parameters.
        _m("gpt3-175b", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=32768, vocab=50257, seq_len=2048),
    ]
}
