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
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn
    s_rows = offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # A K-tile is either a slice of one group (SUB_K == BLOCK_K) or whole groups, one dot each (SUB_K == GROUP_SIZE)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K: no K mask
        for sub in tl.static_range(BLOCK_K // SUB_K):
            offs_k = k0 + sub * SUB_K + tl.arange(0, SUB_K)
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            if BITS == 8:
                q = tl.load(q_rows + offs_k[:, None], mask=n_mask[None, :], other=0)
            else:
                packed = tl.load(q_rows + (offs_k // 2)[:, None], mask=n_mask[None, :], other=0)
                q = (packed >> ((offs_k % 2) * 4).to(tl.uint8)[:, None]) & 0x0F
            group = (k0 + sub * SUB_K) // GROUP_SIZE
            scale = tl.load(scale_ptr + s_rows + group, mask=n_mask, other=0.0)
            partial = tl.dot(a.to(DOT_DTYPE), q.to(DOT_DTYPE), input_precision=DOT_PREC)
            acc += partial * scale[None, :]
            if BITS == 4:
                offset = tl.load(offset_ptr + s_rows + group, mask=n_mask, other=0.0)
                acc += tl.sum(a.to(tl.float32), axis=1)[:, None] * offset[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_k_for(group_size: int, in_features: int) -> int:
    """The largest K-tile of 16..128 that is a slice of one group or whole groups and tiles the row (groups
    must be multiples of 16: a dot takes at least 16 inputs)."""
    if group_size % 16:
        raise ValueError(f"the Triton quantized matmul takes groups of a multiple of 16 inputs, not {group_size}")
    for block_k in (128, 64, 32, 16):
        if group_size % block_k == 0 or (block_k % group_size == 0 and in_features % block_k == 0):
            return block_k
    raise AssertionError("unreachable: 16 divides the group size")


def pick_tiles(rows: int, out_features: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): few-row steps (decode) are bound by reading the weight, so a short M tile and
    narrow N tiles spread the weight over more programs; many rows get square tiles that reuse each weight
    tile across more rows."""
    if rows <= 16:
        return 16, 64
    if rows <= 32:
        return 32, 64
    return 64, 128 if out_features >= 4096 else 64


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group_size: int, bits: int, *, block_m: int, block_n: int, block_k: int) -> torch.Tensor:
    """x [M, K] (float32, float16 or bfloat16) @ w.T -> [M, N] in x's dtype, fp32 accumulation; the weight as
    QuantizedWeight holds it (qweight, scale, offset, group_size, bits). block_k: a slice of a group or whole
    groups, dividing K (block_k_for)."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quantized matmul takes float32, float16 or bfloat16 activations, got {x.dtype}")
    rows, in_features = x.shape
    if min(block_k, group_size) < 16 or (group_size % block_k and (block_k % group_size or in_features % block_k)):
        raise ValueError(f"block_k {block_k} must be a slice of the groups of {group_size} or whole groups, "
                         f"dividing {in_features} inputs, and at least 16")
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
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _quant_matmul_kernel[grid](
        x, qweight, scale, offset, out, rows, out_features, in_features,
        x.stride(0), qweight.stride(0), scale.stride(0), out.stride(0),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SUB_K=min(block_k, group_size),
        DOT_DTYPE=dot_dtype(x.dtype), DOT_PREC=dot_precision(x.dtype),
    )
    return out


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x [..., in_features] @ w.T for a QuantizedWeight (any leading dims), tiles picked from the shapes."""
    leading = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    block_m, block_n = pick_tiles(flat.shape[0], weight.qweight.shape[0])
    out = quantized_matmul(flat, weight.qweight, weight.scale, weight.offset, weight.group_size, weight.bits,
                           block_m=block_m, block_n=block_n, block_k=block_k_for(weight.group_size, flat.shape[1]))
    return out.reshape(*leading, out.shape[-1])
