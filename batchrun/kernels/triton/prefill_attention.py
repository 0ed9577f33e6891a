"""Paged prefill / extend attention: a sequence's last query_len of seq_len stored tokens attend causally through
its block table (prefix hits and later chunks alike). Programs: (sequence, query head, BLOCK_M tokens)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.layouts.kv_rows import as_bytes
from batchrun.kernels.triton._common import check_kv_cache, dot_dtype, dot_precision, fp8_code, fp8_values
from batchrun.kernels.triton.decode_attention import (
    LOG2E,
    attend_ref,
    gather_context,
    load_scales,
    scores_log2,
)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c, stride_cb, stride_ct, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - query_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < query_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if QUANT or FP8:  # 8-bit K/V: the decode kernel's arithmetic
        q = q.to(DOT_DTYPE)
    else:
        q = q.to(cache_ptr.dtype.element_ty).to(DOT_DTYPE)
    q_pos = cached + offs_m  # rows past query_len see a superset of valid keys: finite, and never stored

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_row = block_tables_ptr + seq * stride_bt
    k_base = cache_ptr + (head // GROUP) * stride_ch
    v_base = k_base + stride_c
    end = tl.minimum(seq_len, cached + (tile + 1) * BLOCK_M)  # the tile's last query sees no further
    # with a window, row q_pos sees keys from q_pos - window + 1: the walk starts at the BLOCK_N tile (the decode
    # kernel's) holding the first row's first key
    lo = tl.maximum(cached + tile * BLOCK_M - window + 1, 0) if WINDOW else 0
    for n0 in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < end) & (offs_n >= lo)  # (a freed block's table entry is never read)
        block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        token = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct
        k = tl.load(k_base + token[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if FP8:
            k = fp8_values(k, FP8)
        dots = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PREC)
        if QUANT:
            dots = dots * load_scales(k_base + token + HEAD_DIM, n_mask)[None, :]
        s = scores_log2(dots, qk_scale, softcap, SOFTCAP)
        seen = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW:
            seen = seen & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # with a window a row may see nothing of a tile: it adds exactly 0 (exp2(-inf)), so the row's result is that
        # of a walk from its own first tile, the decode kernel's
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + token[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if FP8:
            v = fp8_values(v, FP8)
        if QUANT:
            w = (p * load_scales(v_base + token + HEAD_DIM, n_mask)[None, :]).to(out_ptr.dtype.element_ty)
        elif FP8:
            w = p.to(out_ptr.dtype.element_ty)
        else:
            w = p.to(cache_ptr.dtype.element_ty)
        pv = tl.dot(w.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (l_i is 0 only on rows past query_len, never stored)
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q, out [num_tokens, Hq, D]: sequence i's new tokens are q's rows query_start_loc[i]:query_start_loc[i + 1],
    its context (them included, stored) seq_lens[i] tokens through block_tables[i]; window and softcap as in decode
    (a token at p sees (p - window, p]). Rows of out outside every sequence are left alone."""
    check_kv_cache(kv_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len == 0:
        return out
    quant, fp8 = kv_cache.dtype == torch.int8, fp8_code(kv_cache.dtype)
    compute = q.dtype if quant or fp8 else kv_cache.dtype  # 8-bit K/V are widened to the query's dtype
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, block_m))](
        q, as_bytes(kv_cache), out, block_tables, seq_lens, query_start_loc,
        scale if softcap else scale * LOG2E, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(compute), DOT_PREC=dot_precision(compute), WINDOW=window > 0,
        SOFTCAP=softcap > 0, QUANT=quant, FP8=fp8,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Sequence by sequence, slot by slot, in fp64, for tests (rows outside every sequence are zero)."""
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        q_pos = list(range(seq_len - (hi - lo), seq_len))
        out[lo:hi] = attend_ref(q[lo:hi].to(k.dtype), k, v, q_pos, scale, window, softcap).to(q.dtype)
    return out
