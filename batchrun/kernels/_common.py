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
    """int8 pool rows [..., D + 4] (head_dim values, then their float32 scale's bytes: batchrun/model/kv_quant.py,
    which this layer cannot import) -> float32 [..., D], for the references."""
    return packed[..., :-4].float() * packed[..., -4:].contiguous().view(torch.float32)
