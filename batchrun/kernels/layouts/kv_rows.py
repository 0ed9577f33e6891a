"""The quantized KV cache (`kv_cache_dtype: int8`): its format, and the torch reference of its encoding and load
(attention.store_kv_torch scatters what encode_rows gives into any pool).

Format: the pool keeps its layout, [num_layers, 2, num_blocks, block_size, num_kv_heads, row], in int8, where
each (slot, kv head) row is head_dim int8 values followed by the 4 bytes of their float32 scale (row = head_dim +
4). Quantization is symmetric, per token and kv head: scale = absmax * (1/127), q = round(x / scale) (to even), so a
value is off by at most half a step (scale / 2). The scale lives inside the row, not in a tensor of its own, so
that everything that moves blocks (copy-on-write and block copies, swap out to host memory and back in, prefix
sharing, which maps the same blocks) carries the scales with the values without knowing about them.

Per token means a token's stored bytes depend on that token's K/V only: what else is in the step, or whether its
prompt came in one chunk or several, changes nothing (batch invariance holds as it does unquantized).
csrc/attention.c (store_kv_int8, paged_attention_int8) is the C side of the same format.
"""

from __future__ import annotations

import torch

# kv_cache_dtype -> the pool's dtype (None: the model's dtype, today's pool)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8,
                                                  "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_BYTES = 4  # the float32 scale at the end of each int8 row


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """An int8 pool: rows of values and their scale."""
    return kv_cache.dtype == torch.int8


def is_fp8(kv_cache: torch.Tensor) -> bool:
    """An fp8 pool: each value cast to fp8 on its own (saturated at the format's largest), no scale, rows of
    head_dim as in the model's dtype. Simpler and coarser than int8 (3 or 2 mantissa bits)."""
    return kv_cache.dtype in FP8


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """An fp8 pool viewed as uint8 (torch has no index_copy_ for fp8 on a CPU: block moves copy the bytes); any
    other pool as it is."""
    return pool.view(torch.uint8) if pool.dtype in FP8 else pool


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x cast to an fp8 dtype, clamped to its finite range first (e5m2 would overflow to inf)."""
    top = torch.finfo(dtype).max
    return x.float().clamp(-top, top).to(dtype)


def encode_rows(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., D] as a pool of `pool_dtype` stores them: int8 rows with their scale (quantize_rows),
    fp8 values as their bytes (uint8: torch has no index_copy_ for fp8 on a CPU), or the values cast."""
    if pool_dtype == torch.int8:
        return quantize_rows(x)
    if pool_dtype in FP8:
        return to_fp8(x, pool_dtype).view(torch.uint8)
    return x.to(pool_dtype)


def row_width(head_dim: int, kv_dtype: torch.dtype | None) -> int:
    """Elements of one (slot, kv head) row of the pool: head_dim, or head_dim + the scale's bytes in int8."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 [..., D + 4]: the values, then their float32 scale's bytes."""
    x = x.float()
    # times the float32 1/127, not divided by 127: torch on CUDA turns a division by a scalar into that product,
    # and the C and Triton stores spell it the same way, so all of them write the same bytes
    scale = x.abs().amax(-1, keepdim=True) * (1.0 / 127.0)
    q = torch.where(scale > 0, torch.round(x / scale), 0.0).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def scales(packed: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each row of an int8 pool (or of a part of one): [..., 1]."""
    return packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 4] -> float32 [..., D] (value x scale)."""
    return packed[..., :-SCALE_BYTES].float() * scales(packed)
