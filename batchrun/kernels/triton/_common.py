"""Helpers the Triton kernels share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.layouts import kv_rows

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """What `tl.dot` takes for `dtype`: itself, but fp32 for bf16 under the interpreter (its dot multiplies bits)."""
    if dtype not in _TL_DTYPES:
        raise TypeError(f"paged kernels support float32, float16 and bfloat16, got {dtype}")
    if interpreting() and dtype == torch.bfloat16:
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """Exact fp32 products for fp32 (not tf32); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must have unit stride on head_dim")


# fp8 pools are read and written as their bytes (kv_rows.as_bytes), converted in integer ops: the interpreter's own
# fp32 -> e5m2 cast rounds otherwise than torch's, and spelled out the interpreter, a GPU and torch agree.
def fp8_code(dtype: torch.dtype) -> int:
    """The FP8 constexpr of a pool of `dtype`: 0 not fp8, 1 e4m3fn, 2 e5m2 (kv_rows.FP8's order)."""
    return kv_rows.FP8.index(dtype) + 1 if dtype in kv_rows.FP8 else 0


@triton.jit
def fp8_bytes(x, FP8: tl.constexpr):
    """float32 -> fp8 bytes (int32) exactly as kv_rows.to_fp8: clamped, to nearest even, subnormals included."""
    if FP8 == 1:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        TOP: tl.constexpr = 448.0
        MAGIC: tl.constexpr = 16384.0  # 2^14: its float32 step is e4m3's subnormal step, 2^-9
        MAGIC_BITS: tl.constexpr = 141 << 23
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        TOP: tl.constexpr = 57344.0
        MAGIC: tl.constexpr = 128.0  # 2^7: step 2^-16, e5m2's subnormal step
        MAGIC_BITS: tl.constexpr = 134 << 23
    x = tl.minimum(tl.maximum(x, -TOP), TOP)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    sub = (mag.to(tl.float32, bitcast=True) + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    odd = (mag >> (23 - MANT)) & 1
    normal = (mag + (((BIAS - 127) << 23) + (1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)
    return tl.where(mag < ((128 - BIAS) << 23), sub, normal) | sign


@triton.jit
def fp8_values(raw, FP8: tl.constexpr):
    """fp8 bytes (uint8) -> float32, torch's values, decoded through the fp16 whose bits they are."""
    b = raw.to(tl.int32)
    if FP8 == 1:
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        x = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((b & 0x7F) == 0x7F, float("nan"), x)
    return (b << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
