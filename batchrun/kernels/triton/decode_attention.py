"""Paged decode attention: one query token per sequence. A program takes (sequence, KV head, partition) with all the
head's query heads (GQA); long contexts split into partitions, merged by a second kernel. The grid depends on shapes
only (graph-capturable), the partitions on a row's own length (batch invariant: docs/reproducibility-kernels.md)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from batchrun.kernels.layouts import kv_rows
from batchrun.kernels.triton._common import check_kv_cache, dot_dtype, dot_precision, fp8_code, fp8_values

LOG2E = 1.4426950408889634
# the same inside kernels: compiled Triton reads only module globals declared constexpr (the interpreter reads any)
LOG2E_IN_KERNEL = tl.constexpr(LOG2E)
# partition_size=None: one partition longer than any context (a fixed constexpr, so no recompilation per length)
WHOLE_CONTEXT = 1 << 30


@triton.jit
def scores_log2(dots, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in log2 units for exp2: dots * qk_scale, or soft-capped (qk_scale then the plain scale)."""
    if SOFTCAP:
        x = dots * qk_scale / softcap
        return softcap * (2.0 * tl.sigmoid(2.0 * x) - 1.0) * LOG2E_IN_KERNEL
    return dots * qk_scale


@triton.jit
def load_scales(at, mask):
    """The float32 scales of int8 rows, 4 aligned bytes at each row's `at` (head_dim a multiple of 4)."""
    return tl.load(at.to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)


@triton.jit
def _decode_partition_kernel(
    q_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
    qk_scale, window, softcap,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_c, stride_cb, stride_ct, stride_ch, stride_bt,
    stride_ps, stride_ph, stride_pp, stride_ls, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION
    # partition 0 always runs, so that an empty (padding) sequence gets zeros
    if start >= tl.maximum(seq_len, 1):
        return
    end = tl.minimum(start + PARTITION, seq_len)
    # a sliding window sees keys [lo, seq_len); the walk starts at the key tile holding lo, as prefill's does
    lo = tl.maximum(seq_len - window, 0) if WINDOW else 0
    first = tl.maximum(start, lo // BLOCK_N * BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if QUANT or FP8:  # 8-bit K/V are widened (exactly) to the query's dtype
        q = q.to(DOT_DTYPE)
    else:
        q = q.to(cache_ptr.dtype.element_ty).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_row = block_tables_ptr + seq * stride_bt
    k_base = cache_ptr + kv_head * stride_ch
    v_base = k_base + stride_c
    for n0 in range(first, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < end) & (offs_n >= lo)  # (a freed block's table entry is never read)
        block = tl.load(block_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        token = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct
        k = tl.load(k_base + token[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        if FP8:
            k = fp8_values(k, FP8)
        dots = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PREC)
        if QUANT:  # each key's int8 scale folded into its scores
            dots = dots * load_scales(k_base + token + HEAD_DIM, n_mask)[None, :]
        s = scores_log2(dots, qk_scale, softcap, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + token[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if FP8:
            v = fp8_values(v, FP8)
        # p rounded to the cache dtype for the product (8-bit: to the model's, int8's value scales multiplied in first)
        if QUANT:
            w = (p * load_scales(v_base + token + HEAD_DIM, n_mask)[None, :]).to(out_ptr.dtype.element_ty)
        elif FP8:
            w = p.to(out_ptr.dtype.element_ty)
        else:
            w = p.to(cache_ptr.dtype.element_ty)
        pv = tl.dot(w.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # l_i is 0 only for an empty sequence, whose output is zeros
    out = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_out_ptr + seq * stride_ps + heads[:, None] * stride_ph + part * stride_pp + offs_d[None, :],
                 out, mask=out_mask)
        tl.store(part_lse_ptr + seq * stride_ls + heads * stride_lh + part, lse, mask=g_mask)
    else:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr,
    stride_os, stride_oh, stride_ps, stride_ph, stride_pp, stride_ls, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PARTITION: tl.constexpr,
):
    # each partition's normalised output weighted by its share of the softmax mass
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_parts = tl.maximum(tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION), 1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    lse_row = part_lse_ptr + seq * stride_ls + head * stride_lh
    lse = tl.load(lse_row + offs_p, mask=offs_p < num_parts, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence: every lse is -inf
    total = tl.sum(tl.exp2(lse - m), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    part_row = part_out_ptr + seq * stride_ps + head * stride_ph
    for p in range(0, num_parts):
        w = tl.exp2(tl.load(lse_row + p) - m)
        acc += w * tl.load(part_row + p * stride_pp + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    partition_size: int | None = 512,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [num_seqs, Hq, D] over one layer's kv_cache [2, num_blocks, block_size, Hkv, D], seq_lens int32 (the new
    token's K/V stored); max_seq_len (>= each) sizes the grid; partition_size None: never split. window > 0: the last
    `window` keys only; softcap > 0: scores capped to softcap * tanh(s / softcap). Never syncs with the device."""
    if partition_size is None:
        partition_size = WHOLE_CONTEXT
    check_kv_cache(kv_cache)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if partition_size % block_n:
        raise ValueError(f"partition_size ({partition_size}) must be a multiple of block_n ({block_n})")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    num_parts = max(1, math.ceil(max_seq_len / partition_size))
    split = num_parts > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    else:  # unused: the kernel writes `out` directly
        part_out = part_lse = out
    block_d = triton.next_power_of_2(head_dim)
    quant, fp8 = kv_cache.dtype == torch.int8, fp8_code(kv_cache.dtype)
    compute = q.dtype if quant or fp8 else kv_cache.dtype  # 8-bit K/V are widened to the query's dtype
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, kv_rows.as_bytes(kv_cache), out, part_out, part_lse, block_tables, seq_lens,
        scale if softcap else scale * LOG2E, window, softcap,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        part_out.stride(0) if split else 0, part_out.stride(1) if split else 0, part_out.stride(2) if split else 0,
        part_lse.stride(0) if split else 0, part_lse.stride(1) if split else 0,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=kv_cache.shape[2], BLOCK_N=block_n, PARTITION=partition_size, SPLIT=split,
        DOT_DTYPE=dot_dtype(compute), DOT_PREC=dot_precision(compute), WINDOW=window > 0,
        SOFTCAP=softcap > 0, QUANT=quant, FP8=fp8,
    )
    if split:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens,
            out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(num_parts), PARTITION=partition_size,
        )
    return out


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first `seq_len` tokens, slot by slot: [seq_len, Hkv, D] (an 8-bit pool's in fp32)."""
    block_size = kv_cache.shape[2]
    blocks = block_table.tolist()
    slots = [(blocks[pos // block_size], pos % block_size) for pos in range(seq_len)]
    keys = torch.stack([kv_cache[0, block, offset] for block, offset in slots])
    values = torch.stack([kv_cache[1, block, offset] for block, offset in slots])
    if kv_rows.is_quantized(kv_cache):
        return kv_rows.dequantize(keys), kv_rows.dequantize(values)
    if kv_rows.is_fp8(kv_cache):
        return keys.float(), values.float()
    return keys, values


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int], scale: float, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
    """fp64 causal attention (GQA, window, softcap) of q [num_q, Hq, D] at q_pos over k, v [num_k, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    for row, pos in enumerate(q_pos):
        scores[:, row, pos + 1 :] = float("-inf")
        if window:
            scores[:, row, : max(pos - window + 1, 0)] = float("-inf")
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """Sequence by sequence, slot by slot, in fp64, for tests."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        out[i] = attend_ref(q[i : i + 1].to(k.dtype), k, v, [seq_len - 1], scale, window,
                            softcap)[0].to(q.dtype)
    return out
