"""A boundary tensor moved scattered between stages of equal tp (runtime.interpreter): each TP rank
sends slice t of the flattened tensor, the receiver posts slice_numel elements per slice and
rebuilds the tensor from the all-gather's output (the slices end to end). Where tp does not
divide the tensor the last slices are zero-padded and the padding dropped again: bit for bit
the tensor sent, for every size. (No model shape reaches the padding today -- tp divides the
heads, which divide hidden, so tests/test_runtime_tp.py's tp 2/2 losses never pad.)"""

from __future__ import annotations

import pytest
import torch

from geotrain.runtime.interpreter import boundary_from_slices, boundary_slice, slice_numel


@pytest.mark.parametrize("shape,tp", [((2, 3, 5), 2), ((2, 3, 5), 4), ((1, 7, 3), 3), ((2, 4, 6), 2), ((1, 1, 1), 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scattered_slices_rebuild_the_tensor_when_tp_does_not_divide_it(shape, tp, dtype):
    x = torch.randn(shape).to(dtype)
    k = slice_numel(x.numel(), tp)
    slices = [boundary_slice(x, tp, t) for t in range(tp)]
    assert [s.numel() for s in slices] == [k] * tp          # every rank sends what the receiver posts
    assert all(s.is_contiguous() and s.dtype == dtype for s in slices)
    full = torch.cat(slices)                                # all_gather into full.chunk(tp): end to end
    assert torch.equal(full[x.numel():], torch.zeros(tp * k - x.numel(), dtype=dtype))   # the padding
    back = boundary_from_slices(full, shape)
    assert back.shape == x.shape and torch.equal(back, x)
