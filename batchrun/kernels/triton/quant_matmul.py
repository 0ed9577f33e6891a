"""y = x @ w.T for a QuantizedWeight read as stored: within a group sum x w = scale * sum x q (+ offset * sum x), so
each group's slice of a K-tile is one exact `tl.dot` on the integers, scaled in fp32. choose_path picks this, a
CUDA-core GEMV or the dequantized weight for torch's matmul by row count (timings: docs/quantization.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from batchrun.kernels.triton._common import dot_dtype, dot_precision

if TYPE_CHECKING:
    from batchrun.kernels.layouts.quant_weight import QuantizedWeight

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
    k_start = tl.program_id(2) * K_SPLIT  # split-K: this program's share of the inputs
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # a [K, N] tile's columns (int8)
    q_cols = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn  # an [N, K / 2] tile's rows (int4)
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # a K-tile is a slice of one group (SUB_K == BLOCK_K) or whole groups, one dot each (SUB_K == GROUP_SIZE)
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
            else:
                # int4: each byte read once, its nibbles interleaved back into input order, one dot
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                packed = tl.load(q_cols + (k_first // 2 + tl.arange(0, SUB_K // 2))[None, :], mask=n_mask[:, None],
                                 other=0)
                q = tl.interleave(packed & 0x0F, packed >> 4)  # [BLOCK_N, SUB_K]: input 2j low, 2j + 1 high
                partial = tl.dot(a.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), input_precision=DOT_PREC)
                row_sums = tl.sum(a.to(tl.float32), axis=1)
            acc += partial * scale[None, :]
            if BITS == 4:
                offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)
                acc += row_sums[:, None] * offset[None, :]
    out_rows = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _quant_gemv_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, out_ptr,
    N, K_SPLIT,
    stride_xm, stride_qn, stride_sn, stride_os, stride_om,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
):
    # one row per program, the row fastest over the grid: a step's rows read a weight tile together (HBM once)
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_SPLIT
    n_mask = offs_n < N
    x_row = x_ptr + row * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    s_rows = offs_n.to(tl.int64) * stride_sn
    # summed element-wise over the K-tiles, reduced across columns once at the end (not per K-tile: shuffles)
    if BITS == 8:
        acc = tl.zeros([BLOCK_N, SUB_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, SUB_K // 2], tl.float32)
    for k0 in range(k_start, k_start + K_SPLIT, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):  # each SUB_K slice lies in one group
            k_first = k0 + sub * SUB_K
            group = k_first // GROUP_SIZE
            scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
            if BITS == 8:
                offs_k = k_first + tl.arange(0, SUB_K)
                a = tl.load(x_row + offs_k).to(tl.float32)
                q = tl.load(q_rows + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.float32)
                acc += q * scale * a[None, :]
            else:  # each byte once: its low nibble against the even input, its high one against the odd
                offs_pair = tl.arange(0, SUB_K // 2)
                packed = tl.load(q_rows + (k_first // 2 + offs_pair)[None, :], mask=n_mask[:, None], other=0)
                offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
                even = tl.load(x_row + k_first + 2 * offs_pair).to(tl.float32)
                odd = tl.load(x_row + k_first + 2 * offs_pair + 1).to(tl.float32)
                acc += ((packed & 0x0F).to(tl.float32) * scale + offset) * even[None, :]
                acc += ((packed >> 4).to(tl.float32) * scale + offset) * odd[None, :]
    out_row = out_ptr + tl.program_id(2).to(tl.int64) * stride_os + row * stride_om
    tl.store(out_row + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, offset_ptr, out_ptr,
    N, stride_qn, stride_sn, stride_on,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
):
    # bound by the bytes written: a scale (offset) per output row and group slice, each packed byte read once
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    s_rows = offs_n.to(tl.int64) * stride_sn
    out_rows = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on
    for sub in tl.static_range(BLOCK_K // SUB_K):
        k_first = tl.program_id(1) * BLOCK_K + sub * SUB_K
        group = k_first // GROUP_SIZE
        scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
        offs_k = k_first + tl.arange(0, SUB_K)
        if BITS == 8:
            w = tl.load(q_rows + offs_k[None, :], mask=n_mask[:, None], other=0).to(tl.float32) * scale
        else:
            packed = tl.load(q_rows + (k_first // 2 + tl.arange(0, SUB_K // 2))[None, :], mask=n_mask[:, None],
                             other=0)
            offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)[:, None]
            low = (packed & 0x0F).to(tl.float32) * scale + offset
            high = (packed >> 4).to(tl.float32) * scale + offset
            w = tl.reshape(tl.join(low, high), [BLOCK_N, SUB_K])  # [n, j, 2] -> [n, 2j + nibble]
        tl.store(out_rows + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def block_k_for(group_size: int, in_features: int) -> int:
    """The largest K-tile of 16..128 that is a slice of a group or whole groups and tiles the row."""
    if group_size % 16:
        raise ValueError(f"the Triton quantized matmul takes groups of a multiple of 16 inputs, not {group_size}")
    for block_k in (128, 64, 32, 16):
        if group_size % block_k == 0 or (block_k % group_size == 0 and in_features % block_k == 0):
            return block_k
    raise AssertionError("unreachable: 16 divides the group size")


@dataclass(frozen=True)
class Tiles:

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4


def pick_tiles(rows: int, out_features: int, in_features: int, bits: int, block_k: int) -> Tiles:
    """The MMA kernel's tiles, from a GPU tile sweep on Llama-3-8B's MLP shapes: a few rows (weight-bound) take wide
    tiles with split-K to fill the GPU, more rows square tiles that reuse a weight tile across rows."""
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


def _weight_operands(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight's tensors, contiguous; for 8 bits the scale stands in for the unread offset."""
    qweight, scale = qweight.contiguous(), scale.contiguous()
    return qweight, scale, offset.contiguous() if offset is not None else scale


def _prepare(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
             group_size: int, bits: int, block_k: int, split_k: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quantized matmul takes float32, float16 or bfloat16 activations, got {x.dtype}")
    in_features = x.shape[1]
    if min(block_k, group_size) < 16 or (group_size % block_k and (block_k % group_size or in_features % block_k)):
        raise ValueError(f"block_k {block_k} must be a slice of the groups of {group_size} or whole groups, "
                         f"dividing {in_features} inputs, and at least 16")
    if split_k < 1 or (in_features // block_k) % split_k:
        raise ValueError(f"split_k {split_k} must divide the {in_features // block_k} K-tiles of {block_k}")
    if qweight.shape[1] * (2 if bits == 4 else 1) != in_features:
        raise ValueError(f"activations of {in_features} inputs for a weight of shape {tuple(qweight.shape)}")
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)
    return (x if x.stride(1) == 1 else x.contiguous(), *_weight_operands(qweight, scale, offset), out)


def _split_target(out: torch.Tensor, split_k: int) -> torch.Tensor:
    if split_k == 1:
        return out
    return torch.empty(split_k, *out.shape, dtype=torch.float32, device=out.device)


def _sum_partials(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target is not out:
        out.copy_(target.sum(dim=0))  # in fp32, in a fixed order, rounded once
    return out


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group_size: int, bits: int, *, block_m: int, block_n: int, block_k: int, split_k: int = 1,
                     num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (fp32, fp16 or bf16) @ w.T -> [M, N] in x's dtype, fp32 sums; the weight as QuantizedWeight's fields.
    block_k as block_k_for gives; split_k > 1 shares the K-tiles out, the fp32 partials summed in a fixed order."""
    x, qweight, scale, offset, out = _prepare(x, qweight, scale, offset, group_size, bits, block_k, split_k)
    (rows, in_features), out_features = x.shape, qweight.shape[0]
    if rows == 0:
        return out
    target = _split_target(out, split_k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n), split_k)
    _quant_matmul_kernel[grid](
        x, qweight, scale, offset, target, rows, out_features, in_features, in_features // split_k,
        x.stride(0), qweight.stride(0), scale.stride(0), target.stride(0) if split_k > 1 else 0, target.stride(-2),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SUB_K=min(block_k, group_size),
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return _sum_partials(out, target)


def quantized_gemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                   group_size: int, bits: int, *, block_n: int, block_k: int, split_k: int = 1,
                   num_warps: int = 4) -> torch.Tensor:
    """quantized_matmul's product for a few rows on the CUDA cores (a dot would pad them to 16)."""
    x, qweight, scale, offset, out = _prepare(x, qweight, scale, offset, group_size, bits, block_k, split_k)
    (rows, in_features), out_features = x.shape, qweight.shape[0]
    if rows == 0:
        return out
    target = _split_target(out, split_k)
    grid = (rows, triton.cdiv(out_features, block_n), split_k)
    _quant_gemv_kernel[grid](
        x, qweight, scale, offset, target, out_features, in_features // split_k,
        x.stride(0), qweight.stride(0), scale.stride(0), target.stride(0) if split_k > 1 else 0, target.stride(-2),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=min(block_k, group_size),
        num_warps=num_warps,
    )
    return _sum_partials(out, target)


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group_size: int,
                      bits: int, dtype: torch.dtype, block_n: int = 64) -> torch.Tensor:
    """The weight [N, K] in `dtype` (w = q * scale (+ offset) per group, computed in fp32, rounded once)."""
    out_features, in_features = qweight.shape[0], qweight.shape[1] * (2 if bits == 4 else 1)
    block_k = block_k_for(group_size, in_features)
    qweight, scale, offset = _weight_operands(qweight, scale, offset)
    out = torch.empty(out_features, in_features, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(out_features, block_n), in_features // block_k)
    _dequantize_kernel[grid](qweight, scale, offset, out, out_features, qweight.stride(0), scale.stride(0),
                             out.stride(0), GROUP_SIZE=group_size, BITS=bits, BLOCK_N=block_n, BLOCK_K=block_k,
                             SUB_K=min(block_k, group_size))
    return out


# The product a step takes by its row count, read off the H200 timings in docs/quantization.md. The dequantized
# weight is a transient [out, in] tensor (the memory profile runs the step-token budget through it).
GEMV_MAX_ROWS = {4: 2, 8: 0}
DEQUANTIZE_FROM_ROWS = {4: 3, 8: 128}
PATHS = ("gemv", "mma", "dequantize")


def choose_path(rows: int, bits: int) -> str:
    if rows <= GEMV_MAX_ROWS[bits]:
        return "gemv"
    return "dequantize" if rows >= DEQUANTIZE_FROM_ROWS[bits] else "mma"


def gemv_tiles(rows: int, out_features: int, in_features: int, block_k: int) -> Tiles:
    """64 outputs per program, the K-tiles shared by up to 8 programs until about 1024 programs fill the GPU."""
    k_tiles = in_features // block_k
    split = 1
    while split < 8 and k_tiles % (2 * split) == 0 and rows * triton.cdiv(out_features, 64) * split * 2 <= 1024:
        split *= 2
    return Tiles(1, 64, split)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, path: str | None = None) -> torch.Tensor:
    """x [..., in_features] @ w.T; the product by choose_path, or `path` (one of PATHS)."""
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    rows, in_features = flat.shape
    path = path or choose_path(rows, weight.bits)
    fields = (weight.qweight, weight.scale, weight.offset, weight.group_size, weight.bits)
    if path == "dequantize":
        out = torch.nn.functional.linear(flat, dequantize_weight(*fields, dtype=flat.dtype))
        return out.reshape(*leading, out.shape[-1])
    block_k = block_k_for(weight.group_size, in_features)
    if path == "gemv":
        tiles = gemv_tiles(rows, weight.qweight.shape[0], in_features, block_k)
        out = quantized_gemv(flat, *fields, block_n=tiles.block_n, block_k=block_k, split_k=tiles.split_k)
    elif path == "mma":
        tiles = pick_tiles(rows, weight.qweight.shape[0], in_features, weight.bits, block_k)
        out = quantized_matmul(flat, *fields, block_m=tiles.block_m, block_n=tiles.block_n, block_k=block_k,
                               split_k=tiles.split_k, num_warps=tiles.num_warps)
    else:
        raise ValueError(f"path {path!r} is not one of {PATHS}")
    return out.reshape(*leading, out.shape[-1])
