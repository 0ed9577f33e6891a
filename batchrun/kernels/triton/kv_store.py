"""Writing one step's K and V into their paged-cache slots, before attention reads them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.layouts.kv_rows import as_bytes
from batchrun.kernels.triton._common import check_kv_cache, fp8_bytes, fp8_code


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c, stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    # one program per token, all its KV heads: a strided copy, each value cast to the pool's dtype (fp8: its byte)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h[:, None] * stride_ch \
        + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + src, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:
        k, v = fp8_bytes(k.to(tl.float32), FP8), fp8_bytes(v.to(tl.float32), FP8)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_c + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, mask, HEAD_DIM: tl.constexpr):
    """fp32 rows [BLOCK_H, BLOCK_D] -> (int8 values, float32 scales) as kv_rows.quantize_rows gives them."""
    x = tl.where(mask, x, 0.0)
    # the scale times the float32 1/127 (as torch on CUDA); div_rn: IEEE division, not an approximate one
    scale = tl.max(tl.abs(x), 1) * (1.0 / 127.0)
    y = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None])
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)  # ties to even, as torch.round
    r = tl.minimum(tl.maximum(r, -127.0), 127.0)
    return r.to(tl.int8), scale


@triton.jit
def _store_kv_int8_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c, stride_cb, stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h * stride_ch
    for which in tl.static_range(2):
        src = (k_ptr + t * stride_kt + offs_h[:, None] * stride_kh) if which == 0 else \
            (v_ptr + t * stride_vt + offs_h[:, None] * stride_vh)
        x = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        values, scale = _quantize_rows(x, mask, HEAD_DIM)
        base = cache_ptr + which * stride_c + row
        tl.store(base[:, None] + offs_d[None, :], values, mask=mask)
        tl.store((base + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=h_mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, Hkv, D] into one layer's kv_cache [2, num_blocks, block_size, Hkv, D] (int8 or fp8 pools
    encoded as kv_rows.encode_rows does); slot_mapping int64 [num_tokens], -1 for padding (skipped)."""
    check_kv_cache(kv_cache)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must have unit stride on head_dim")
    if kv_cache.dtype == torch.int8:
        _store_kv_int8_kernel[(num_tokens,)](
            k, v, kv_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=kv_cache.shape[2],
        )
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, as_bytes(kv_cache), slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], FP8=fp8_code(kv_cache.dtype),
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Token by token, for tests."""
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[0, slot // block_size, slot % block_size] = k[t].to(kv_cache.dtype)
        kv_cache[1, slot // block_size, slot % block_size] = v[t].to(kv_cache.dtype)
