"""Paged attention and the KV store on a CPU (csrc/attention.c)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import dtype_flag

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "paged_attention": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _B, _I, _I, _F]),
    "store_kv": (None, [_P, _P, _I, _P, _I, _I, _P, _P, _I]),  # the last: the element size
    "paged_attention_int8": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _B, _I, _F]),
    "store_kv_int8": (None, [_P, _P, _I, _P, _I, _I, _I, _P, _P, _B]),
    "store_kv_fp8": (None, [_P, _P, _I, _P, _I, _I, _P, _P, _B, _B]),
    "paged_attention_fp8": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _B, _I, _F, _B]),
}

# The fewest lanes (a tile's rows x query heads per kv head) that take bf16 attention to AMX outside the
# batch-invariant mode: prefill chunks, not decode rows (docs/cpu-kernels.md has the measurements).
AMX_PREFILL_LANES = 16


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    row_len: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    amx_lanes: int = 1, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """out [N, Hq, D] for decode and prefill rows alike: row i attends to keys [0, row_len[i]) of sequence
    row_seq[i] (int32; its block_tables row) in one layer's kv_cache [2, NB, BS, Hkv, D] (the step's K/V stored). A
    row's bits are its own unless amx_lanes > 1 (then only bf16 tiles of that many lanes go to AMX; 0: none, 1: all).
    window > 0: a row sees its last `window` keys only; softcap > 0: scores capped to softcap * tanh(s / softcap)."""
    n, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    bt = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype)
    k_ptr = kv_cache.data_ptr()  # kv_cache[0] and [1] without two indexing ops per layer
    v_ptr = k_ptr + kv_cache.stride(0) * kv_cache.element_size()
    if _library().paged_attention(q.data_ptr(), q.stride(0), k_ptr, v_ptr, bt.data_ptr(), bt.stride(0),
                                  row_seq.data_ptr(), row_len.data_ptr(), out.data_ptr(), n, hq, hkv, d, bs, scale,
                                  dtype_flag(q), amx_lanes, window, softcap):
        raise MemoryError("paged attention: no memory for the score buffers")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [N, Hkv, D] with the same row stride (views of one qkv row), slot_mapping int64 [N], -1 skipped."""
    n, hkv, d = k.shape
    if k.stride() != v.stride() or k.stride(1) != d:
        k, v = k.contiguous(), v.contiguous()
    k_ptr = kv_cache.data_ptr()
    _library().store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), n, hkv * d,
                        k_ptr, k_ptr + kv_cache.stride(0) * kv_cache.element_size(), k.element_size())


def _paged_attention_8bit(kernel, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          row_seq: torch.Tensor, row_len: torch.Tensor, scale: float, out: torch.Tensor | None,
                          window: int, softcap: float, *format_args) -> torch.Tensor:
    n, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    bt = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype)
    k_ptr = kv_cache.data_ptr()
    if kernel(q.data_ptr(), q.stride(0), k_ptr, k_ptr + kv_cache.stride(0), bt.data_ptr(), bt.stride(0),
              row_seq.data_ptr(), row_len.data_ptr(), out.data_ptr(), n, hq, hkv, d, bs, scale, dtype_flag(q), window,
              softcap, *format_args):
        raise MemoryError("paged attention: no memory for the score buffers")
    return out


def paged_attention_int8(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                         row_len: torch.Tensor, scale: float, out: torch.Tensor | None = None, window: int = 0,
                         softcap: float = 0.0) -> torch.Tensor:
    """paged_attention over an int8 pool [2, NB, BS, Hkv, D + 4] (kv_rows' format); batch invariant."""
    return _paged_attention_8bit(_library().paged_attention_int8, q, kv_cache, block_tables, row_seq, row_len, scale,
                                 out, window, softcap)


def store_kv_int8(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv into an int8 pool, quantized as kv_rows.quantize_rows does (the same bytes)."""
    n, hkv, d = k.shape
    if k.stride() != v.stride() or k.stride(1) != d or k.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    k_ptr = kv_cache.data_ptr()
    _library().store_kv_int8(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), n, hkv, d,
                             k_ptr, k_ptr + kv_cache.stride(0), dtype_flag(k))


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv into an fp8 pool, cast as kv_rows.to_fp8 does (the same bytes)."""
    n, hkv, d = k.shape
    if k.stride() != v.stride() or k.stride(1) != d or k.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    k_ptr = kv_cache.data_ptr()
    _library().store_kv_fp8(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), n, hkv * d,
                            k_ptr, k_ptr + kv_cache.stride(0), dtype_flag(k), int(kv_cache.dtype == torch.float8_e5m2))


def paged_attention_fp8(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                        row_len: torch.Tensor, scale: float, out: torch.Tensor | None = None, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """paged_attention over an fp8 pool (float8_e4m3fn or float8_e5m2); batch invariant."""
    return _paged_attention_8bit(_library().paged_attention_fp8, q, kv_cache, block_tables, row_seq, row_len, scale,
                                 out, window, softcap, int(kv_cache.dtype == torch.float8_e5m2))
