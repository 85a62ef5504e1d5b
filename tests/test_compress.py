"""Compressed tensors on the wire (runtime.compress): the payload is exactly the size the cost
model counts (costs.compression), decodes within the codec's error, and a compressed link's
boundary tensors reach the interpreter whole, with the wire bytes recorded."""

from __future__ import annotations

import pytest
import torch

from geotrain.costs.compression import BOUNDARY_CODECS, OUTER_CODECS, boundary_wire_bytes, outer_wire_bytes
from geotrain.runtime.compress import (
    CompressedTransport,
    decode_boundary,
    decode_outer,
    encode_boundary,
    encode_outer,
)

# Largest error relative to a row's absmax: bf16 8 bits of mantissa, e4m3 3, e5m2 2, int8 1/254.
BOUND = {"none": 0.0, "bf16": 2 ** -8, "fp8-e4m3": 2 ** -4, "fp8-e5m2": 2 ** -3, "int8": 1 / 250}


@pytest.mark.parametrize("codec", BOUNDARY_CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 8, 64), (1, 3, 40), (77,)])     # whole rows, a short last row
def test_boundary_payload_is_the_costed_size_and_decodes_within_the_codecs_error(codec, dtype, shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[-1])).to(dtype)
    row = 64 if len(shape) > 1 else 16
    payload = encode_boundary(x, codec, row)
    assert payload.dtype == torch.uint8
    assert payload.numel() == boundary_wire_bytes(x.numel(), x.element_size(), codec, row)
    out = torch.empty_like(x)
    decode_boundary(payload, out, codec, row)
    flat, rows = x.float().reshape(-1), out.float().reshape(-1)
    for a in range(0, flat.numel(), row):           # per row: error within the codec's share of its absmax
        ref, got = flat[a:a + row], rows[a:a + row]
        rounding = ref.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0.0    # decoded into bf16
        assert ((got - ref).abs() <= BOUND[codec] * ref.abs().max() + rounding + 1e-30).all()
    if codec == "none" or (codec == "bf16" and dtype == torch.bfloat16):
        assert torch.equal(out, x)


def test_low_rank_is_exact_on_a_low_rank_tensor_and_costs_two_factors():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(48, 3, generator=g) @ torch.randn(3, 32, generator=g)).reshape(2, 24, 32)
    payload = encode_boundary(x, "none", 32, rank=4)
    assert payload.numel() == (48 + 32) * 4 * 2
    out = torch.empty_like(x)
    decode_boundary(payload, out, "none", 32, rank=4)
    assert (out - x).abs().max() < 0.02 * x.abs().max()
    state = torch.get_rng_state()
    encode_boundary(x, "none", 32, rank=4)
    assert torch.equal(torch.get_rng_state(), state)     # training's random stream is untouched


@pytest.mark.parametrize("codec", OUTER_CODECS)
@pytest.mark.parametrize("n", [1, 127, 128, 1001])
def test_outer_payload_is_the_costed_size_and_decodes(codec, n):
    v = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = encode_outer(v, codec)
    assert payload.numel() == outer_wire_bytes(n, codec)
    back = decode_outer(payload, n, codec)
    bound = {"fp32": 0.0, "bf16": 2 ** -8, "int8": 1 / 250, "int4": 1 / 14}[codec]
    assert (back - v).abs().max() <= bound * v.abs().max() + 1e-30
    assert torch.equal(decode_outer(payload, n, codec), back)     # deterministic: every worker decodes alike


class _Loopback:
    """An in-process transport: a send's bytes land in the matching posted receive."""

    def __init__(self):
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, tensor, dst, tag):
        self.sent[tag] = tensor.clone()
        return _Done()

    def recv(self, tensor, src, tag):
        tensor.copy_(self.sent.pop(tag))
        return _Done()


class _Done:
    def wait(self):
        return True


def test_a_compressed_transport_delivers_the_decoded_tensor_and_says_its_wire_bytes():
    inner = _Loopback()
    t = CompressedTransport(inner, "int8", 64)
    x = torch.randn(2, 4, 64)
    work = t.send(x, 1, 7)
    assert work.wire_bytes == boundary_wire_bytes(x.numel(), 4, "int8", 64) == 2 * 4 * 64 + 8 * 4
    out = torch.empty_like(x)
    t.recv(out, 0, 7).wait()
    assert (out - x).abs().max() <= x.abs().max() / 250
