"""The Triton quantized matmul (batchrun/kernels/triton/quant_matmul.py) against quant.linear_ref: 4 and 8 bits, groups
of 16, 32, 128 and a whole row, 1, 5 and 33 rows, odd output counts, fp32/fp16/bf16 activations. Without CUDA
the kernel runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1), so the shapes are small and
the grid is a cover of those settings, not their product; one CUDA-only test runs production shapes."""

from __future__ import annotations

import pytest
import torch

from batchrun.kernels.layouts.quant_weight import (
    QuantizedWeight,
    linear_ref,
    pack_int4,
    quantize_int4,
    quantize_int8,
)
from batchrun.kernels.triton import quantized_linear
from batchrun.kernels.triton.quant_matmul import (
    PATHS,
    Tiles,
    block_k_for,
    choose_path,
    dequantize_weight,
    gemv_tiles,
    pick_tiles,
    quantized_gemv,
    quantized_matmul,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to the output's scale


def random_weight(bits: int, out_features: int, in_features: int, group_size: int, seed: int,
                  device=DEVICE) -> QuantizedWeight:
    """Every integer value and signed scales and offsets (as GGUF's Q4_1 / Q4_K hold), not only what
    quantize_int4 / quantize_int8 would produce."""
    gen = torch.Generator().manual_seed(seed)
    groups = (out_features, in_features // group_size)
    scale = torch.randn(groups, generator=gen) * 0.02
    if bits == 8:
        q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
        return QuantizedWeight(8, q.to(device), scale.to(device), None, group_size)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    offset = torch.randn(groups, generator=gen) * 0.1
    return QuantizedWeight(4, pack_int4(q).to(device), scale.to(device), offset.to(device), group_size)


def assert_close_to_ref(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight) -> None:
    want = linear_ref(x, weight)
    assert got.dtype == x.dtype and got.shape == want.shape
    err = (got.float() - want).abs().max().item()
    assert err <= TOL[x.dtype] * max(1.0, want.abs().max().item()), err


# (bits, rows, out_features, in_features, group_size, dtype): every group size, row count and dtype with each
# width; a whole row as the group (in_features == group_size) for both widths.
CASES = [
    (4, 1, 37, 128, 32, torch.float32),
    (4, 5, 19, 256, 128, torch.float16),
    (4, 33, 40, 64, 16, torch.bfloat16),
    (4, 5, 21, 80, 80, torch.float32),  # a whole row of 80: K-tiles of 16
    (4, 1, 64, 192, 192, torch.bfloat16),  # a whole row of 192: K-tiles of 64
    (8, 1, 23, 64, 16, torch.float16),  # Q6_K's groups
    (8, 5, 37, 128, 32, torch.bfloat16),  # Q8_0's groups
    (8, 33, 17, 256, 128, torch.float32),
    (8, 5, 29, 96, 96, torch.float16),  # a whole row (quantize_int8's layout)
    (8, 1, 31, 32, 32, torch.float32),
]


@pytest.mark.parametrize("bits,rows,out_features,in_features,group_size,dtype", CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_quantized_linear_matches_the_reference(bits, rows, out_features, in_features, group_size, dtype):
    """Each case through each of the three products quantized_linear chooses among by the row count."""
    weight = random_weight(bits, out_features, in_features, group_size, seed=rows * out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    for path in PATHS:
        assert_close_to_ref(quantized_linear(x, weight, path), x, weight)


@pytest.mark.parametrize("bits", [4, 8])
def test_k_tiles_smaller_and_larger_than_a_group_and_leading_dims(bits):
    """A K-tile smaller than the group (the same scale over several tiles), one of several groups (a dot
    per group), and [batch, seq, in] activations."""
    weight = random_weight(bits, 24, 128, 32, seed=3)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    for block_k in (16, 64, 128):
        got = quantized_matmul(x.reshape(6, 128), weight.qweight, weight.scale, weight.offset, 32, bits,
                               block_m=16, block_n=16, block_k=block_k)
        assert_close_to_ref(got, x.reshape(6, 128), weight)
    with pytest.raises(ValueError, match="block_k 48 must be"):
        quantized_matmul(x.reshape(6, 128), weight.qweight, weight.scale, weight.offset, 32, bits,
                         block_m=16, block_n=16, block_k=48)
    assert torch.equal(quantized_linear(x, weight).reshape(6, 24), quantized_linear(x.reshape(6, 128), weight))


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64)])
def test_split_k_sums_the_partials_of_each_share(bits, group_size):
    """split_k programs per output tile, each over its share of the K-tiles (int4 in groups of 32 reads each byte
    for both its inputs, from 64 up once for two dots on its nibbles), give the unsplit product; a split that does
    not divide the K-tiles is refused."""
    weight = random_weight(bits, 40, 256, group_size, seed=bits + group_size)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.bfloat16)
    block_k = block_k_for(group_size, 256)
    for split_k in (1, 2, 256 // block_k):
        got = quantized_matmul(x, weight.qweight, weight.scale, weight.offset, group_size, bits, block_m=16,
                               block_n=32, block_k=block_k, split_k=split_k)
        assert_close_to_ref(got, x, weight)
    with pytest.raises(ValueError, match="split_k 3 must divide"):
        quantized_matmul(x, weight.qweight, weight.scale, weight.offset, group_size, bits, block_m=16, block_n=32,
                         block_k=block_k, split_k=3)


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 128), (8, 64), (8, 16)])
def test_gemv_k_tiles_and_splits(bits, group_size):
    """The CUDA-core GEMV over K-tiles inside a group and of several groups, its K-tiles split among programs, and
    its rows (one program each) independent: a row's output is the same alone and among others."""
    weight = random_weight(bits, 40, 256, group_size, seed=bits * group_size)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(13)).to(DEVICE, torch.bfloat16)
    fields = (weight.qweight, weight.scale, weight.offset, group_size, bits)
    for block_k in {block_k_for(group_size, 256), 16 if group_size % 16 == 0 else 32, 128}:
        for split_k in (1, 256 // block_k):
            got = quantized_gemv(x, *fields, block_n=16, block_k=block_k, split_k=split_k)
            assert_close_to_ref(got, x, weight)
            assert torch.equal(got[2:3], quantized_gemv(x[2:3], *fields, block_n=16, block_k=block_k,
                                                        split_k=split_k))
    with pytest.raises(ValueError, match="split_k 3 must divide"):
        quantized_gemv(x, *fields, block_n=16, block_k=64, split_k=3)


@pytest.mark.parametrize("bits,group_size,dtype", [(4, 32, torch.bfloat16), (4, 64, torch.float32),
                                                   (8, 16, torch.float16), (8, 96, torch.bfloat16)])
def test_dequantize_weight_equals_the_reference(bits, group_size, dtype):
    """The weight the many-row path hands torch's matmul: quant.dequantize's, rounded once into `dtype`
    (an odd shape: the tiles' masks; a GPU may fuse q * scale + offset, one fp32 rounding fewer)."""
    from batchrun.kernels.layouts.quant_weight import dequantize

    weight = random_weight(bits, 37, 192, group_size, seed=group_size)
    got = dequantize_weight(weight.qweight, weight.scale, weight.offset, group_size, bits, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, dequantize(weight).to(dtype))


def test_batchruns_own_quantizers_round_trip_through_the_kernel():
    w = torch.randn(20, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    for weight in (quantize_int8(w), quantize_int4(w, 32)):
        got = quantized_linear(x, weight)
        assert_close_to_ref(got, x, weight)
        assert (got - x @ w.T).abs().max() < 0.25 * (x @ w.T).abs().max()  # and near the float weight


def test_tiles_and_refusals():
    pairs = [(16, 64), (16, 48), (32, 128), (32, 96), (48, 96), (128, 256), (576, 576), (4096, 14336)]
    assert [block_k_for(g, k) for g, k in pairs] == [64, 16, 128, 32, 16, 128, 64, 128]
    # (rows, out, in, bits, block_k): decode rows of a long K get wide tiles and split-K, short ones narrow tiles
    assert pick_tiles(1, 4096, 14336, 8, 128) == Tiles(16, 128, 8, 8)
    assert pick_tiles(16, 14336, 4096, 4, 128) == Tiles(16, 128, 8, 8)
    assert pick_tiles(1, 14336, 4096, 8, 128) == Tiles(16, 32)
    assert pick_tiles(1, 576, 576, 4, 64) == Tiles(16, 64)
    assert pick_tiles(1, 4096, 8192 + 64 * 3, 4, 64) == Tiles(16, 128, 1, 8)  # 131 K-tiles: no split divides them
    assert pick_tiles(100, 4096, 14336, 4, 128) == Tiles(64, 64, 2)
    assert pick_tiles(33, 4096, 4096, 8, 128) == Tiles(64, 128) and pick_tiles(20, 576, 576, 8, 64) == Tiles(32, 64)
    # the product by rows: int4 on the GEMV for one or two, else cuBLAS on its dequantized weight; int8 on the MMA
    # kernel up to 127
    assert [choose_path(rows, 4) for rows in (1, 2, 3, 4096)] == ["gemv"] * 2 + ["dequantize"] * 2
    assert [choose_path(rows, 8) for rows in (1, 127, 128)] == ["mma", "mma", "dequantize"]
    assert gemv_tiles(1, 4096, 14336, 128) == Tiles(1, 64, 8) and gemv_tiles(4, 14336, 4096, 128) == Tiles(1, 64, 1)
    assert gemv_tiles(1, 576, 576, 64) == Tiles(1, 64, 1)  # 9 K-tiles: no power of two divides them
    with pytest.raises(ValueError, match="path 'fast' is not one of"):
        quantized_linear(torch.zeros(1, 32, device=DEVICE), random_weight(8, 8, 32, 32, seed=0), "fast")
    with pytest.raises(ValueError, match="groups of a multiple of 16 inputs, not 24"):
        block_k_for(24, 48)
    weight = random_weight(8, 8, 32, 32, seed=0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16 activations"):
        quantized_linear(torch.zeros(1, 32, dtype=torch.float64, device=DEVICE), weight)
    with pytest.raises(ValueError, match="activations of 64 inputs"):
        quantized_linear(torch.zeros(1, 64, device=DEVICE), weight)
    assert quantized_linear(torch.zeros(0, 32, device=DEVICE), weight).shape == (0, 8)


def test_a_models_quantized_linears_on_the_triton_kernel(monkeypatch):
    """QuantLinear's "triton" kernel (what it takes on CUDA; here interpreted where there is none): the bias added
    in the activations' dtype, a fused linear of two formats (MixedQuantLinear), and groups the kernel does not
    take (not a multiple of 16) left to the dequantized torch path."""
    from torch import nn

    from batchrun.model.quant.linear import MixedQuantLinear, QuantLinear, quantized_linear_module

    monkeypatch.setattr(QuantLinear, "default_kernel", None)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    bias = nn.Parameter(torch.randn(40, generator=torch.Generator().manual_seed(8)).to(DEVICE), requires_grad=False)
    parts = [random_weight(4, 24, 64, 32, seed=9), random_weight(8, 16, 64, 16, seed=10)]
    if not HAS_CUDA:
        monkeypatch.setattr(QuantLinear, "default_kernel", "triton")
    module = quantized_linear_module([p.to(torch.device("cpu")) for p in parts], bias, DEVICE)
    assert isinstance(module, MixedQuantLinear) and [p.kernel for p in module.parts] == ["triton", "triton"]
    assert all(p.weight_ref.qweight.device.type == DEVICE.type for p in module.parts)
    want = torch.cat([linear_ref(x, p) for p in parts], dim=-1) + bias
    assert (module(x) - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())
    odd = quantize_int8(torch.randn(8, 48, generator=torch.Generator().manual_seed(11)), 24)
    linear = QuantLinear(odd, None, DEVICE)
    assert linear.kernel == "torch"
    assert torch.allclose(linear(x[:, :48].contiguous()), linear_ref(x[:, :48], odd.to(DEVICE)), atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("bits,group_size", [(8, 32), (8, 16), (8, 4096), (4, 32), (4, 128)])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_production_shapes_on_cuda(bits, group_size, rows):
    """A Llama-3-8B-sized projection (4096 -> 14336 and back) in bf16, the GGUF and int8/int4 group sizes."""
    for out_features, in_features in ((14336, 4096), (4096, 14336)):
        if in_features % group_size:
            continue
        weight = random_weight(bits, out_features, in_features, group_size, seed=rows)
        x = torch.randn(rows, in_features, device=DEVICE, dtype=torch.bfloat16)
        assert_close_to_ref(quantized_linear(x, weight), x, weight)
