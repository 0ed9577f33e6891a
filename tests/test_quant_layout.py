"""batchrun.kernels.layouts.quant_weight: the plain quantized layout every source is read into and every kernel packs from."""

import pytest
import torch

from batchrun.kernels.layouts.quant_weight import (
    QuantizedWeight,
    dequantize,
    linear_ref,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_int4_packing_round_trips_with_even_inputs_in_the_low_nibble():
    values = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(values)
    assert packed.shape == (5, 6)
    assert torch.equal(packed[:, 0] & 0x0F, values[:, 0]) and torch.equal(packed[:, 0] >> 4, values[:, 1])
    assert torch.equal(unpack_int4(packed), values)


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 32), (4, 128)])
def test_quantizing_errs_by_at_most_half_a_step(bits, group_size):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.linspace(0.01, 3.0, 48)[:, None]  # rows of very different scales
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group_size)
    assert qw.shape == (48, 256) and qw.group_size == (256 if bits == 8 else group_size)
    step = qw.scale.repeat_interleave(qw.group_size, dim=1)
    error = (dequantize(qw) - w).abs()
    assert bool((error <= step * 0.5 + 1e-6).all())
    x = torch.randn(3, 256)
    assert torch.allclose(linear_ref(x, qw), x @ dequantize(qw).T)


def test_a_zero_row_quantizes_to_zeros():
    w = torch.zeros(2, 64)
    assert torch.equal(dequantize(quantize_int8(w)), w) and torch.equal(dequantize(quantize_int4(w, 32)), w)


def test_shapes_that_do_not_agree_are_refused():
    with pytest.raises(ValueError, match="groups of 48"):
        quantize_int4(torch.zeros(2, 64), 48)
    with pytest.raises(ValueError, match="offset"):
        QuantizedWeight(bits=8, qweight=torch.zeros(2, 64, dtype=torch.int8), scale=torch.ones(2, 2),
                        offset=torch.zeros(2, 2), group_size=32)
    with pytest.raises(ValueError, match="scales of shape"):
        QuantizedWeight(bits=8, qweight=torch.zeros(2, 64, dtype=torch.int8), scale=torch.ones(2, 1),
                        offset=None, group_size=32)
