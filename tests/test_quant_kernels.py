"""The weight-only quantized linears (csrc/quant_linears.c) against batchrun.kernels.layouts.quant_weight's references.

Two checks per case. (1) Against an emulation of what the kernel computes (the activations quantized per row the
kernel's way, the integer sums exact in float64): within fp32 rounding, so an indexing or packing slip fails.
(2) Against linear_ref (x @ dequantize(w).T in fp32) within the activation quantization's own bound:
|y - ref| <= sum_i |w[o, i]| * |x[r, i] - xs[r] * xq[r, i]| <= 0.5 * xs[r] * sum_i |w[o, i]|, plus the output's
rounding (fp32, or bf16's 2^-8 relative)."""

import pytest
import torch

from batchrun.kernels.cpu import quant as qk
from batchrun.kernels.layouts import quant_weight as quant

pytestmark = pytest.mark.skipif(not qk.available(), reason="needs a C compiler for batchrun's CPU kernels")

KERNELS = ["plain"] + ([qk.kernel()] if qk.kernel() in ("vnni", "avx2") else [])


def _quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization per row and group: xq = rint(x * (127 / max|x|)), xs = max|x| / 127
    ([rows, k] and [rows, k / group])."""
    x = x.to(torch.float32).view(x.shape[0], -1, group)
    m = x.abs().amax(dim=2)
    inv = torch.where(m > 0, torch.tensor(127.0) / m, torch.zeros_like(m))
    return torch.round(x * inv[..., None]).clamp(-127, 127).flatten(1), m / 127.0


def _emulate(x: torch.Tensor, w: quant.QuantizedWeight) -> torch.Tensor:
    group = qk.kernel_group(w)
    xq, xs = _quantize_rows(x, group)
    q = (quant.unpack_int4(w.qweight) if w.bits == 4 else w.qweight).to(torch.float64)
    n, k = w.shape
    groups = k // group
    scale = w.scale.double().repeat_interleave(w.group_size // group, dim=1)
    xg = xq.double().view(-1, groups, group)
    sums = torch.einsum("rgi,ogi->rog", xg, q.view(n, groups, group)) * scale[None]
    if w.offset is not None:
        sums += xg.sum(-1)[:, None, :] * w.offset.double().repeat_interleave(w.group_size // group, dim=1)[None]
    return (sums * xs.double()[:, None, :]).sum(-1)


def _make(bits: int, n: int, k: int, group: int, gen: torch.Generator) -> quant.QuantizedWeight:
    w = torch.randn(n, k, generator=gen) * 0.05
    if bits == 8:
        qw = quant.quantize_int8(w)
        if group != k:  # int8 with smaller groups (GGUF's Q8_0 / Q6_K): the same integers, a scale per group
            scale = qw.scale.repeat(1, k // group) * torch.rand(n, k // group, generator=gen).add(0.5)
            qw = quant.QuantizedWeight(8, qw.qweight, scale, None, group)
        return qw
    qw = quant.quantize_int4(w, group)
    # an offset that is not -8 * scale (GGUF's Q4_1 / Q4_K)
    return quant.QuantizedWeight(4, qw.qweight, qw.scale, qw.offset + 0.01 * torch.randn(qw.offset.shape,
                                                                                          generator=gen), group)


CASES = [  # (bits, out, in, group)
    (8, 67, 128, 128), (8, 96, 256, 32), (8, 33, 64, 16), (8, 40, 576, 576),
    (4, 67, 128, 32), (4, 96, 256, 128), (4, 33, 64, 16), (4, 50, 96, 96),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits,n,k,group", CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64, 300])  # 2: the two-row tile with its second sums
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_matches_the_references(kernel, bits, n, k, group, rows, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k + group + bits)
    w = _make(bits, n, k, group, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    y = qk.linear(x, qk.pack(w), bias, plain=kernel == "plain")
    assert y.dtype == dtype and y.shape == (rows, n)
    emulated = _emulate(x, w) + bias.double()
    out_round = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(y.double(), emulated, rtol=out_round, atol=1e-5 * emulated.abs().max().item())
    ref = quant.linear_ref(x, w).double() + bias.double()
    group = qk.kernel_group(w)
    _, xs = _quantize_rows(x, group)
    w_abs = quant.dequantize(w).abs().double().view(n, k // group, group).sum(-1)
    bound = 0.5 * (xs.double()[:, None, :] * w_abs[None]).sum(-1)
    assert ((y.double() - ref).abs() <= bound + out_round * ref.abs() + 1e-5).all()


def test_quant_linear_bf16_in_fp32_out_and_zero_rows():
    gen = torch.Generator().manual_seed(0)
    w = quant.quantize_int8(torch.randn(48, 64, generator=gen))
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    x[2] = 0  # a zero row: scale 0, output exactly the bias (none here)
    y = qk.linear(x, qk.pack(w), out_dtype=torch.float32)
    assert y.dtype == torch.float32 and (y[2] == 0).all()
    assert torch.allclose(y.double(), _emulate(x, w), rtol=1e-5, atol=1e-4)
    assert qk.linear(x[:0], qk.pack(w)).shape == (0, 48)


def test_weights_the_kernel_cannot_take_are_refused():
    w = quant.quantize_int4(torch.randn(8, 36), group_size=12)
    assert not qk.supports(w)
    with pytest.raises(ValueError, match="multiples of 8"):
        qk.pack(w)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("bits,n,k,group", [(8, 67, 256, 128), (4, 67, 256, 128), (4, 40, 96, 32)])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kernel, bits, n, k, group):
    """Batch invariance: a row alone, and in each slot of 1-, 2-, 3- and 4-row tiles of a larger call, in the
    first or a later block of 64 rows, gives the same bits (integer sums exact, fp32 steps per row in one order
    whatever the tile or block)."""
    gen = torch.Generator().manual_seed(bits + n + k)
    packed = qk.pack(_make(bits, n, k, group, gen))
    total = 150
    x = torch.randn(total, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([qk.linear(x[i : i + 1], packed, None, plain=kernel == "plain") for i in range(total)])
    for rows in (2, 3, 5, 11, 70, 150):
        together = torch.cat([qk.linear(x[i : i + rows], packed, None, plain=kernel == "plain")
                              for i in range(0, total, rows)])
        assert torch.equal(together, alone), rows
