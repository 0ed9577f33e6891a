"""Paged attention and the KV store on a CPU (csrc/attention.c): the ctypes wrappers the torch backend calls
(attention.TorchBackend with cpu_kernels)."""

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
    "paged_attention_fp8": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _B, _I, _F, _B]),
}

# The fewest lanes (a tile's rows x query heads per kv head) for which bf16 attention goes to AMX outside the
# batch-invariant mode: prefill chunks, not decode rows (csrc/attention.c, amx_attend_head, has the measurements).
AMX_PREFILL_LANES = 16


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    row_len: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    amx_lanes: int = 1, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Paged attention for any mix of decode and prefill / extend query rows, in one call.

    q [N, Hq, D] (rows may be strided, e.g. a view of the fused qkv projection); kv_cache [2, NB, BS, Hkv, D]
    (one layer, q's dtype) already holding the step's K/V; block_tables int32 [S, >= blocks of the longest
    row]; row_seq int32 [N]: each row's sequence (its block-table row); row_len int32 [N]: each row attends to
    keys [0, row_len) of its sequence (a decode row: the context length; a prefill row at position p: p + 1).
    Rows of one sequence should be consecutive (they share K/V loads). Returns out [N, Hq, D].
    A row's result depends on that row's query, keys and values only, bit for bit (batch invariance), unless
    amx_lanes > 1: bf16 tiles of at least that many lanes (rows x query heads per kv head: prefill chunks) then go
    to AMX where the CPU has it, the others (decode rows) to the vector kernel; 0 keeps all on the vector kernel,
    1 (the default) puts all on AMX where it runs.
    window > 0: a sliding window, each row attending only its last `window` keys (block-table entries of blocks
    wholly before a row's window are never read). softcap > 0: scores soft-capped to softcap * tanh(s / softcap)
    before the softmax (Gemma 2)."""
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
    """The call both 8-bit pools share: the kernel of the pool's format, its extra arguments last."""
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
    """paged_attention's contract over an int8 pool (batchrun.kernels.layouts.kv_rows's format): kv_cache int8
    [2, NB, BS, Hkv, D + 4]; q and out fp32 or bf16. Batch invariant."""
    return _paged_attention_8bit(_library().paged_attention_int8, q, kv_cache, block_tables, row_seq, row_len, scale,
                                 out, window, softcap)


def store_kv_int8(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize k, v [N, Hkv, D] (fp32 or bf16, the same row stride) into their slots of one layer's int8 pool
    (kv_quant.quantize_rows' bytes); slot_mapping int64 [N], -1 skipped."""
    n, hkv, d = k.shape
    if k.stride() != v.stride() or k.stride(1) != d or k.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    k_ptr = kv_cache.data_ptr()
    _library().store_kv_int8(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), n, hkv, d,
                             k_ptr, k_ptr + kv_cache.stride(0), dtype_flag(k))


def paged_attention_fp8(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                        row_len: torch.Tensor, scale: float, out: torch.Tensor | None = None, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
    """paged_attention's contract over an fp8 pool (float8_e4m3fn or float8_e5m2, [2, NB, BS, Hkv, D]); q and out
    fp32 or bf16. Batch invariant."""
    return _paged_attention_8bit(_library().paged_attention_fp8, q, kv_cache, block_tables, row_seq, row_len, scale,
                                 out, window, softcap, int(kv_cache.dtype == torch.float8_e5m2))
