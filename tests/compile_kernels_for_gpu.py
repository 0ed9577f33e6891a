"""Compile every Triton kernel of batchrun for a Hopper GPU (sm_90) on a machine without one.

The kernel tests run interpreted on CPUs, and the interpreter is Python: it lets through what the GPU compiler
refuses (a kernel reading a plain module global, say, which the first GPU run found in the soft-capped
attention). This script drives the kernel wrappers on CPU tensors with Triton's launch replaced by a recorder,
then compiles each recorded specialisation with Triton's own compiler and ptxas down to a cubin, as the first
launch on a GPU would. Run by tests/test_kernels_compile.py in a fresh process: TRITON_INTERPRET must be unset
when the kernels are defined.

    python tests/compile_kernels_for_gpu.py     # prints one line per specialisation; exit 1 if any failed
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_kernels_for_gpu.py needs TRITON_INTERPRET unset (the kernels must be compiled, not interpreted)")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchrun.kernels.layouts.quant_weight import quantize_int4, quantize_int8  # noqa: E402
from batchrun.kernels.triton import (  # noqa: E402 - after the path and the environment check
    copy_blocks,
    grouped_gemm,
    moe_align,
    paged_decode_attention,
    paged_prefill_attention,
    quantized_linear,
    store_kv,
)
from batchrun.kernels.triton.quant_matmul import PATHS  # noqa: E402
from batchrun.kernels.triton.sampling import sample_rows  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
TENSOR_TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                torch.bool: "i1"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def argument_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TENSOR_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


class Recorder:
    """Stands in for JITFunction.run: keeps one entry per distinct specialisation, launches nothing."""

    def __init__(self) -> None:
        self.launches: dict[tuple, tuple[JITFunction, dict, dict, dict]] = {}

    def __call__(self, kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        bound = dict(zip(kernel.arg_names, args)) | kwargs
        signature, constexprs = {}, {}
        for param in kernel.params:
            value = bound.get(param.name, param.default)
            if param.is_constexpr or value is None:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
            else:
                signature[param.name] = argument_type(value)
        key = (kernel.fn.__qualname__, tuple(signature.items()), tuple((k, str(v)) for k, v in constexprs.items()),
               tuple(options.items()))
        self.launches.setdefault(key, (kernel, signature, constexprs, options))


def kv_pool(dtype: torch.dtype, num_blocks: int = 12, block_size: int = 16, num_kv_heads: int = 2,
            head_dim: int = 64) -> torch.Tensor:
    """One layer's pool; an int8 pool carries each row's fp32 scale in 4 extra bytes, as the engine's does."""
    width = head_dim + 4 if dtype == torch.int8 else head_dim
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, width, dtype=dtype)


# (K/V dtype, head_dim, decode partition_size, window, softcap): each kernel branch at least once; the K/V dtypes
# fp32, bf16, int8 and fp8 (bf16 queries), split and unsplit decode, a window with soft-capping, a head_dim not a power of 2
ATTENTION_CASES = [
    (torch.float32, 64, None, 0, 0.0),
    (torch.bfloat16, 96, 64, 32, 30.0),
    (torch.int8, 64, 64, 0, 0.0),
    (torch.int8, 128, None, 32, 30.0),
    (torch.float8_e4m3fn, 64, 64, 0, 0.0),
    (torch.float8_e5m2, 128, None, 32, 30.0),
]


def drive_kernels() -> None:
    """Each wrapper once per branch its kernels compile differently (ATTENTION_CASES; int8 and int4 weights, per
    row and in groups, bf16 and fp32 activations, one and many rows; the sampler's filters off and on)."""
    heads, kv_heads = 8, 2
    for cache_dtype, head_dim, partition, window, softcap in ATTENTION_CASES:
        q_dtype = torch.bfloat16 if cache_dtype.itemsize == 1 else cache_dtype
        cache = kv_pool(cache_dtype, num_kv_heads=kv_heads, head_dim=head_dim)
        tables = torch.arange(12, dtype=torch.int32).view(2, 6)
        seq_lens = torch.tensor([40, 90], dtype=torch.int32)
        k = torch.zeros(5, kv_heads, head_dim, dtype=q_dtype)
        store_kv(k, k, cache, torch.arange(5, dtype=torch.int64))
        q = torch.zeros(2, heads, head_dim, dtype=q_dtype)
        paged_decode_attention(q, cache, tables, seq_lens, 0.125, 90, partition_size=partition, block_n=32,
                               window=window, softcap=softcap)
        q_rows = torch.zeros(7, heads, head_dim, dtype=q_dtype)
        starts = torch.tensor([0, 3, 7], dtype=torch.int32)
        paged_prefill_attention(q_rows, cache, tables, seq_lens, starts, 4, 0.125, window=window, softcap=softcap)
    copy_blocks(torch.zeros(2, 2, 6, 16, 2, 64), torch.tensor([[0, 1], [2, 3]], dtype=torch.int64))

    for dtype in (torch.float32, torch.bfloat16):
        pair_of_row, _, tile_expert = moe_align(torch.tensor([0, 1, 1, 2, 0, 2]), 3, 16)
        token_of_row = torch.where(pair_of_row >= 0, pair_of_row // 2, -1)
        grouped_gemm(torch.zeros(3, 32, dtype=dtype), token_of_row, tile_expert, torch.zeros(3, 64, 32, dtype=dtype),
                     block_m=16)

    weight = torch.randn(256, 512)
    for quantized, activations, rows in ((quantize_int8(weight), torch.bfloat16, 1),
                                         (quantize_int8(weight, 32), torch.bfloat16, 48),
                                         (quantize_int4(weight, 128), torch.float32, 1),
                                         (quantize_int4(weight, 32), torch.bfloat16, 48),
                                         (quantize_int4(weight, 16), torch.bfloat16, 1)):
        for path in PATHS:  # the CUDA-core GEMV, the MMA kernel, the weight dequantized for torch's matmul
            quantized_linear(torch.zeros(rows, 512, dtype=activations), quantized, path)
    # a decode step of a long projection: 128-wide tiles, split-K, 8 warps (pick_tiles)
    quantized_linear(torch.zeros(1, 4096, dtype=torch.bfloat16), quantize_int4(torch.randn(4096, 4096), 128))

    logits, temperature, u = torch.zeros(3, 1000), torch.ones(3), torch.rand(3, dtype=torch.float64)
    sample_rows(logits, temperature, None, None, None, u)
    sample_rows(logits, temperature, torch.tensor([5, 0, 2]), torch.tensor([0.9, 1.0, 0.5]),
                torch.tensor([0.0, 0.1, 0.0]), u)


def compile_one(kernel: JITFunction, signature: dict, constexprs: dict, options: dict) -> str:
    """'' when it compiled, else the compiler's message."""
    try:
        triton.compile(ASTSource(kernel, signature, constexprs), target=HOPPER, options=options or None)
    except Exception as exc:  # noqa: BLE001 - each specialisation's compiler error is reported, then the rest
        return f"{type(exc).__name__}: {' | '.join(str(exc).strip().splitlines()[:12])}"
    return ""


def main() -> int:
    recorder = Recorder()
    original = JITFunction.run
    JITFunction.run = lambda self, *args, **kwargs: recorder(self, *args, **kwargs)
    try:
        drive_kernels()
    finally:
        JITFunction.run = original
    started = time.perf_counter()
    launches = list(recorder.launches.values())
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:  # the compiler's passes and ptxas run outside the GIL
        errors = list(pool.map(lambda launch: compile_one(*launch), launches))
    for (kernel, _, constexprs, _), error in zip(launches, errors):
        flags = ", ".join(f"{k}={v}" for k, v in constexprs.items() if isinstance(v, bool | int) or v is None)
        print(f"{'FAILED' if error else 'ok'} {kernel.fn.__name__} ({flags}){': ' + error if error else ''}")
    failed = sum(map(bool, errors))
    print(f"compiled in {time.perf_counter() - started:.1f}s")
    print(f"{len(recorder.launches)} specialisations, {failed} failed")
    return 1 if failed or not recorder.launches else 0


if __name__ == "__main__":
    sys.exit(main())
