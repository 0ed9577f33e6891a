"""Small helpers shared by the kernel wrappers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def interpreting() -> bool:
    """True when `@triton.jit` produced interpreted functions (TRITON_INTERPRET=1 at import time)."""
    return bool(triton.knobs.runtime.interpret)


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype fed to `tl.dot` for K/V stored as `dtype`.

    On a GPU the storage dtype itself (tensor cores). Under the interpreter bf16 is widened to fp32, because the
    interpreter keeps bf16 as raw uint16 and its `tl.dot` multiplies the bit patterns
    (triton-lang/triton#11584); bf16 -> fp32 is exact, so only the accumulation order differs.
    """
    if dtype not in _TL_DTYPES:
        raise TypeError(f"paged kernels support float32, float16 and bfloat16, got {dtype}")
    if interpreting() and dtype == torch.bfloat16:
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 K/V get exact fp32 products (tf32 would lose ~3 digits); the option is ignored for 16-bit inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kv_cache(kv_cache: torch.Tensor) -> None:
    """A layer's pool: [2, num_blocks, block_size, num_kv_heads, head_dim] with unit stride on head_dim."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must have unit stride on head_dim")


def dequantize_rows(packed: torch.Tensor) -> torch.Tensor:
    """int8 pool rows [..., D + 4] (head_dim values, then their float32 scale's bytes: batchrun/kernels/layouts/kv_rows.py,
    which this layer cannot import) -> float32 [..., D], for the references."""
    return packed[..., :-4].float() * packed[..., -4:].contiguous().view(torch.float32)


# ---- fp8 pools (kv_cache_dtype fp8_e4m3 / fp8_e5m2: each value one byte, no scale) ------------------------------
# The kernels read and write an fp8 pool as its bytes (a uint8 view) and do both conversions in integer ops: the
# Triton interpreter's own fp32 -> e5m2 cast rounds otherwise than torch's (30.98 came out as 16), so spelled out,
# the interpreter, a GPU and torch's CPU cast all give the same bytes and values.

# pool dtype -> the kernels' FP8 constexpr (0: not fp8); each format's constants live in fp8_bytes
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def fp8_code(dtype: torch.dtype) -> int:
    """The FP8 constexpr of a pool of `dtype`: 0 not fp8, 1 e4m3fn, 2 e5m2."""
    return FP8_FORMATS.get(dtype, 0)


def as_kernel_pool(kv_cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is handed of a pool: an fp8 pool's bytes, any other pool as it is (kv_quant.as_bytes, which
    this layer cannot import)."""
    return kv_cache.view(torch.uint8) if kv_cache.dtype in FP8_FORMATS else kv_cache


@triton.jit
def fp8_bytes(x, FP8: tl.constexpr):
    """float32 values -> their fp8 bytes (int32, 0..255) as torch casts them after clamping to the format's finite
    range (kv_quant.to_fp8): round to nearest, ties to even, subnormals included (c10's conversion: an add of a
    power of two rounds a subnormal at its step; a normal value's bits are rounded by adding half a step less one
    and the kept lowest bit)."""
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
    """fp8 bytes (a uint8 tile) -> float32, exactly torch's values: an e5m2 byte is the high byte of the fp16 of its
    value; e4m3fn's magnitude bits moved to fp16's places are the fp16 of its value / 256 (subnormals too), and its
    one NaN pattern (S.1111.111) is made NaN."""
    b = raw.to(tl.int32)
    if FP8 == 1:
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        x = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        return tl.where((b & 0x7F) == 0x7F, float("nan"), x)
    return (b << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
