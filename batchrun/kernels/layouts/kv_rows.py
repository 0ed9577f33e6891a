"""The 8-bit KV pools' formats and their torch reference (docs/kv-cache.md). An int8 (slot, kv head) row is head_dim
values, then the 4 bytes of their float32 scale, absmax * (1/127), values rounded to even: the row carries its
scale through every block move, and depends on its token alone. fp8: each value cast on its own. The C, Triton and
torch stores write the same bytes."""

from __future__ import annotations

import torch

# kv_cache_dtype -> the pool's dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8,
                                                  "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_BYTES = 4  # the float32 scale at the end of each int8 row


def is_quantized(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in FP8


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """An fp8 pool as its bytes (torch has no fp8 index_copy_ on a CPU), any other pool as it is."""
    return pool.view(torch.uint8) if pool.dtype in FP8 else pool


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x cast to fp8, clamped to the format's finite range first (e5m2 would overflow to inf)."""
    top = torch.finfo(dtype).max
    return x.float().clamp(-top, top).to(dtype)


def encode_rows(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., D] as a pool of `pool_dtype` stores them (fp8 as its bytes)."""
    if pool_dtype == torch.int8:
        return quantize_rows(x)
    if pool_dtype in FP8:
        return to_fp8(x, pool_dtype).view(torch.uint8)
    return x.to(pool_dtype)


def row_width(head_dim: int, kv_dtype: torch.dtype | None) -> int:
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
    """The float32 scale of each int8 row: [..., 1]."""
    return packed[..., -SCALE_BYTES:].contiguous().view(torch.float32)


def dequantize(packed: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 4] -> float32 [..., D] (value x scale)."""
    return packed[..., :-SCALE_BYTES].float() * scales(packed)
