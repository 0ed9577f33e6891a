"""y = x @ w.T for a quantized weight in batchrun's plain layout (batchrun.model.quant.QuantizedWeight), the
weight dequantized in the matmul's inner loop: it is read from memory as stored (1 byte or half a byte per
weight, plus a scale, and for 4 bits an offset, per group) and never widened in memory.

The layout (8 bits: w = q * scale[o, g]; 4 bits: w = q * scale[o, g] + offset[o, g], q 0..15 two per byte, the
even input in the low nibble; g = i // group_size) lets a tile of K that lies inside one group factor its
scale out of the dot product:

    sum_k x[m, k] w[n, k] = scale[n, g] * sum_k x[m, k] q[n, k] + offset[n, g] * sum_k x[m, k]

so each group's slice of a K-tile is one `tl.dot` on the integers themselves (exact in fp16/bf16/fp32:
|q| <= 127) and one per-column scale and offset applied to the fp32 partial sum. A K-tile is a slice of one
group or a few whole groups (one dot each: groups of 16 or 32 still get 64- or 128-wide tiles); groups are
any multiple of 16 (16, 32, 128, a whole row...). The dot runs in the activations' dtype, accumulating in
fp32. The reference is batchrun.model.quant.linear_ref.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from batchrun.kernels._common import dot_dtype, dot_precision

if TYPE_CHECKING:  # the kernels layer sits below the model; the weight is read by its fields only
    from batchrun.model.quant import QuantizedWeight

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, K_SPLIT,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_SPLIT  # split-K: this program's share of the inputs (K_SPLIT == K: all)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # A K-tile is either a slice of one group (SUB_K == BLOCK_K) or whole groups, one dot each (SUB_K == GROUP_SIZE)
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):  # K_SPLIT is a multiple of BLOCK_K: no K mask
        for sub in tl.static_range(BLOCK_K // SUB_K):
            k_first = k0 + sub * SUB_K
            group = k_first // GROUP_SIZE
            scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)
            if BITS == 8:
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                q = tl.load(q_rows + offs_k[:, None], mask=n_mask[None, :], other=0)
                partial = tl.dot(a.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PREC)
            elif SUB_K >= 64:
                # each byte read once: its low nibbles (even inputs) and high nibbles (odd inputs) are two dots
                # against the even and the odd activations. Measured on an H200 against the branch below
                # (Llama-3-8B's MLP shapes, same tiles): groups of 128 at 1-256 rows took 0.46-0.73x its time;
                # groups of 32 (two dots of 16 inputs) 0.87-0.94x at 1 row but 1.15-1.21x at 16 and 1.55-2.10x at
                # 64-256 rows, so groups under 64 take the branch below
                offs_pair = tl.arange(0, SUB_K // 2)
                packed = tl.load(q_rows + (k_first // 2 + offs_pair)[:, None], mask=n_mask[None, :], other=0)
                even = tl.load(x_rows + (k_first + 2 * offs_pair)[None, :], mask=m_mask[:, None], other=0.0)
                odd = tl.load(x_rows + (k_first + 2 * offs_pair + 1)[None, :], mask=m_mask[:, None], other=0.0)
                partial = tl.dot(even.to(DOT_DTYPE), (packed & 0x0F).to(DOT_DTYPE), input_precision=DOT_PREC)
                partial += tl.dot(odd.to(DOT_DTYPE), (packed >> 4).to(DOT_DTYPE), input_precision=DOT_PREC)
                row_sums = tl.sum(even.to(tl.float32), axis=1) + tl.sum(odd.to(tl.float32), axis=1)
            else:  # each byte read for both of its inputs (groups of 16: a dot takes at least 16 inputs)
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                packed = tl.load(q_rows + (offs_k // 2)[:, None], mask=n_mask[None, :], other=0)
                q = (packed >> ((offs_k % 2) * 4).to(tl.uint8)[:, None]) & 0x0F
                partial = tl.dot(a.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PREC)
                row_sums = tl.sum(a.to(tl.float32), axis=1)
            acc += partial * scale[None, :]
            if BITS == 4:
                offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)
                acc += row_sums[:, None] * offset[None, :]
    out_rows = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(group_size: int, in_features: int) -> int:
    """The largest K-tile of 16..128 that is a slice of one group or whole groups and tiles the row (groups
    must be multiples of 16: a dot takes at least 16 inputs)."""
    if group_size % 16:
        raise ValueError(f"the Triton quantized matmul takes groups of a multiple of 16 inputs, not {group_size}")
    for block_k in (128, 64, 32, 16):
        if group_size % block_k == 0 or (block_k % group_size == 0 and in_features % block_k == 0):
            return block_k
    raise AssertionError("unreachable: 16 divides the group size")


@dataclass(frozen=True)
class Tiles:
    """One launch's tiling: output tiles of block_m x block_n, split_k programs per output tile, num_warps each."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4


def pick_tiles(rows: int, out_features: int, in_features: int, bits: int, block_k: int) -> Tiles:
    """Read off `benchmarks.gpu_check`'s tile sweep on an H200 (2026-12-04; Llama-3-8B's MLP shapes 4096 -> 14336
    and 14336 -> 4096, bf16 activations, 1, 16 and 128 rows; docs/quantization.md). A step of a few rows (decode)
    is bound by reading the weight, and with K = 14336 its 4096 outputs in tiles of 64 made 64 programs for 132
    multiprocessors: 128-wide tiles with the K-tiles shared by 8 programs took 0.48-0.50x the time of (16, 64) for
    int8 and 0.21-0.44x for int4; for int4 at K = 4096, 0.71-0.93x (groups of 32 timed on the nibble branch,
    which they no longer take). int8 at K = 4096 keeps one program per tile, 32 wide (0.91-0.92x; a split lost
    there, its partials' sum being a second launch on a 31 us matmul). From 17 rows on, square
    tiles reuse each weight tile across rows; at 128 rows and K = 14336, 64 x 64 tiles split in two took
    0.42-0.74x the time of (64, 128). Not measured on other shapes: small models keep the narrow tiles."""
    k_tiles = in_features // block_k

    def split(most: int) -> int:  # the largest power of two up to `most` that divides the K-tiles
        while k_tiles % most:
            most //= 2
        return most

    if rows <= 16:
        if in_features >= 8192 or (bits == 4 and out_features >= 4096 and in_features >= 4096):
            return Tiles(16, 128, split(8), num_warps=8)
        return Tiles(16, 32 if bits == 8 and out_features >= 4096 else 64)
    if rows <= 128 and in_features >= 8192:
        return Tiles(64, 64, split(2))
    if rows <= 32:
        return Tiles(32, 64)
    return Tiles(64, 128 if out_features >= 4096 else 64)


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group_size: int, bits: int, *, block_m: int, block_n: int, block_k: int, split_k: int = 1,
                     num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16) @ w.T -> [M, N] in x's dtype, fp32 accumulation; the weight as
    QuantizedWeight holds it (qweight, scale, offset, group_size, bits). block_k: a slice of a group or whole
    groups, dividing K (block_k_for). split_k > 1: the K-tiles are shared among that many programs per output
    tile, each writing an fp32 partial sum, added up afterwards in a fixed order (for decode shapes, whose few
    output tiles would leave most of a GPU idle)."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quantized matmul takes float32, float16 or bfloat16 activations, got {x.dtype}")
    rows, in_features = x.shape
    if min(block_k, group_size) < 16 or (group_size % block_k and (block_k % group_size or in_features % block_k)):
        raise ValueError(f"block_k {block_k} must be a slice of the groups of {group_size} or whole groups, "
                         f"dividing {in_features} inputs, and at least 16")
    if split_k < 1 or (in_features // block_k) % split_k:
        raise ValueError(f"split_k {split_k} must divide the {in_features // block_k} K-tiles of {block_k}")
    out_features = qweight.shape[0]
    if qweight.shape[1] * (2 if bits == 4 else 1) != in_features:
        raise ValueError(f"activations of {in_features} inputs for a weight of shape {tuple(qweight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, scale = qweight.contiguous(), scale.contiguous()
    offset = offset.contiguous() if offset is not None else scale  # never read for 8 bits
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    target = out if split_k == 1 else torch.empty(split_k, rows, out_features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), split_k)
    _quant_matmul_kernel[grid](
        x, qweight, scale, offset, target, rows, out_features, in_features, in_features // split_k,
        x.stride(0), qweight.stride(0), scale.stride(0), target.stride(0) if split_k > 1 else 0, target.stride(-2),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SUB_K=min(block_k, group_size),
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    if split_k > 1:
        out.copy_(target.sum(dim=0))  # the partials added in fp32, rounded once into x's dtype
    return out


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [..., in_features] @ w.T for a QuantizedWeight (any leading dims), tiles picked from the shapes."""
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    block_k = block_k_for(weight.group_size, flat.shape[1])
    tiles = pick_tiles(flat.shape[0], weight.qweight.shape[0], flat.shape[1], weight.bits, block_k)
    out = quantized_matmul(flat, weight.qweight, weight.scale, weight.offset, weight.group_size, weight.bits,
                           block_m=tiles.block_m, block_n=tiles.block_n, block_k=block_k, split_k=tiles.split_k,
                           num_warps=tiles.num_warps)
    return out.reshape(*leading, out.shape[-1])
