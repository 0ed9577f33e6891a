"""Paged attention: the step's metadata, the backend contract, and the torch backend. A step is a flat batch, decodes
first; a backend stores the step's K/V, then attends over the cache, so a prefix hit or a chunk is a prefill with
cached tokens. Pool: [layers, 2, blocks, block_size, kv_heads, head_dim], slot s at block s // block_size; an int8
pool's rows are head_dim + 4 wide, the fp32 scale last (batchrun/kernels/layouts/kv_rows.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from batchrun.kernels.cpu import attention as cpu_attention
from batchrun.kernels.layouts.kv_rows import as_bytes, dequantize, encode_rows, is_fp8, is_quantized


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about one step; built once per step by the runner."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each new token's K/V goes; -1 = padding, skip
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: physical block ids, padded with 0
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length after this step (cached + new)
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: offsets of each sequence's new tokens
    num_decodes: int  # sequences [0, num_decodes) have exactly one new token
    max_query_len: int
    max_seq_len: int
    # Host copies of the per-sequence lengths, known to the scheduler anyway: the CPU path uses them to
    # slice without a device sync.
    seq_lens_host: list[int]
    query_lens_host: list[int]
    has_padding: bool = False  # any slot_mapping entry is -1 (set by whoever pads: CUDA graph replays)
    # Per query row, int32 on the host: its sequence and how many keys it sees (position + 1), for the CPU kernel's
    # one call per step. None: derived from the host lists (query_rows).
    row_seq: torch.Tensor | None = None
    row_len: torch.Tensor | None = None
    # sequences [num_decodes, num_decodes + num_verifies) check draft tokens: a few rows each, taken as decode rows
    num_verifies: int = 0

    @cached_property
    def max_decode_len(self) -> int:
        return max(self.seq_lens_host[: self.num_decodes], default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @cached_property
    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row_seq, row_len): the runner's, or built once per step from the host lists."""
        if self.row_seq is not None and self.row_len is not None:
            return self.row_seq, self.row_len
        num_rows = sum(self.query_lens_host)
        if num_rows == self.num_seqs:  # decode only: one row per sequence
            return torch.arange(num_rows, dtype=torch.int32), torch.tensor(self.seq_lens_host, dtype=torch.int32)
        qlens = torch.tensor(self.query_lens_host)
        row_seq = torch.repeat_interleave(torch.arange(self.num_seqs), qlens)
        first = torch.cumsum(qlens, 0) - qlens  # the first row of each sequence
        first_len = torch.tensor(self.seq_lens_host) - qlens + 1  # keys seen by that row
        row_len = torch.arange(num_rows) - first[row_seq] + first_len[row_seq]
        return row_seq.to(torch.int32), row_len.to(torch.int32)


class AttentionBackend(ABC):
    """One forward of attention for one layer. Implementations must not allocate persistent state."""

    name = "base"

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the step's K/V, then attend: a query at p sees keys [p - window + 1, p] (window 0: [0, p]), scores
        scale * q.k, capped to softcap * tanh(s / softcap) when softcap > 0."""


def store_kv_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   has_padding: bool = False) -> None:
    """Scatter the step's K/V into their slots in the pool's format (padding slots, -1, dropped)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = as_bytes(kv_cache).view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if has_padding:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, encode_rows(k, kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, encode_rows(v, kv_cache.dtype))


class TorchBackend(AttentionBackend):
    """Torch attention for CPUs, and a reference everywhere. With `cpu_kernels` the K/V store and every query row
    are C kernels; a prefill row at p is a decode over keys [0, p], so a row's result is the same in any prefill
    split, after a prefix hit or as a decode. `sdpa_prefill` (for comparison) gives prefill rows to SDPA instead."""

    name = "torch"

    def __init__(self, cpu_kernels: bool = False, sdpa_prefill: bool = False, batch_invariant: bool = True) -> None:
        self.cpu_kernels = cpu_kernels
        self.sdpa_prefill = sdpa_prefill and cpu_kernels
        # bf16 on AMX: every row there when batch invariant, else only prefill tiles (cpu_attention.paged_attention)
        self.amx_lanes = 1 if batch_invariant else cpu_attention.AMX_PREFILL_LANES

    def forward(self, q, k, v, kv_cache, meta, scale, window=0, softcap=0.0):
        if self.cpu_kernels and (is_quantized(kv_cache) or is_fp8(kv_cache)):
            # every row on the 8-bit pool's kernel (sdpa_prefill would need the pool dequantized first)
            row_seq, row_len = meta.query_rows
            if is_fp8(kv_cache):
                cpu_attention.store_kv_fp8(k, v, kv_cache, meta.slot_mapping)
                return cpu_attention.paged_attention_fp8(q, kv_cache, meta.block_tables, row_seq, row_len, scale,
                                                         window=window, softcap=softcap)
            cpu_attention.store_kv_int8(k, v, kv_cache, meta.slot_mapping)
            return cpu_attention.paged_attention_int8(q, kv_cache, meta.block_tables, row_seq, row_len, scale,
                                                      window=window, softcap=softcap)
        if self.cpu_kernels:
            return self._forward_cpu_kernels(q, k, v, kv_cache, meta, scale, window, softcap)
        store_kv_torch(k, v, kv_cache, meta.slot_mapping, meta.has_padding)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(q, kv_cache, meta, scale, window, softcap)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, window, softcap)
        if nd < meta.num_seqs:
            self._prefill(q, k, v, kv_cache, meta, scale, out, window=window, softcap=softcap)
        return out

    def _forward_cpu_kernels(self, q, k, v, kv_cache, meta, scale, window=0, softcap=0.0):
        """The kernel attends every row, or with sdpa_prefill only decode and draft rows (prefill rows: SDPA)."""
        cpu_attention.store_kv(k, v, kv_cache, meta.slot_mapping)
        row_seq, row_len = meta.query_rows
        short = meta.num_decodes + meta.num_verifies  # the decode and draft-checking sequences lead the batch
        sdpa_rows = self.sdpa_prefill and short < meta.num_seqs
        kernel_rows = sum(meta.query_lens_host[:short]) if sdpa_rows else row_seq.shape[0]
        if kernel_rows == q.shape[0]:
            return cpu_attention.paged_attention(q, kv_cache, meta.block_tables, row_seq, row_len, scale,
                                                 amx_lanes=self.amx_lanes, window=window, softcap=softcap)
        # rows past kernel_rows: SDPA's prefill rows, or padded rows (none on the CPU paths today) that stay zero
        out = torch.empty_like(q) if sdpa_rows else torch.zeros(q.shape, dtype=q.dtype)
        if kernel_rows:
            cpu_attention.paged_attention(q[:kernel_rows], kv_cache, meta.block_tables, row_seq[:kernel_rows],
                                          row_len[:kernel_rows], scale, out=out[:kernel_rows], amx_lanes=self.amx_lanes,
                                          window=window, softcap=softcap)
        if sdpa_rows:
            self._prefill(q, k, v, kv_cache, meta, scale, out, first=short, window=window, softcap=softcap)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_tables: torch.Tensor, ctx: int):
        """Each sequence's K and V, contiguous: [num_seqs, num_kv_heads, ctx, head_dim] (fp32 from an 8-bit pool)."""
        bs = kv_cache.shape[2]
        nblk = (ctx + bs - 1) // bs
        bt = block_tables[:, :nblk].long()
        kk = kv_cache[0][bt]  # [S, nblk, bs, Hkv, D]
        vv = kv_cache[1][bt]
        if is_quantized(kv_cache):
            kk, vv = dequantize(kk), dequantize(vv)
        elif is_fp8(kv_cache):
            kk, vv = kk.float(), vv.float()
        s = bt.shape[0]
        kk = kk.view(s, nblk * bs, *kk.shape[3:])[:, :ctx].transpose(1, 2)
        vv = vv.view(s, nblk * bs, *vv.shape[3:])[:, :ctx].transpose(1, 2)
        return kk, vv

    def _decode(self, q, kv_cache, meta, scale, window=0, softcap=0.0):
        nd = q.shape[0]
        ctx = meta.max_decode_len
        kk, vv = self._gather(kv_cache, meta.block_tables[:nd], ctx)
        mask = None
        if min(meta.seq_lens_host[:nd]) != ctx or (window and window < ctx):
            pos = torch.arange(ctx, device=q.device)[None, :]
            lens = meta.seq_lens[:nd, None]
            mask = pos < lens
            if window:
                mask &= pos >= lens - window
            mask = mask.view(nd, 1, 1, ctx)
        o = attend(q.unsqueeze(2).to(kk.dtype), kk, vv, mask, scale, softcap)
        return o.squeeze(2).to(q.dtype)

    def _prefill(self, q, k, v, kv_cache, meta, scale, out, first: int | None = None, window=0, softcap=0.0):
        """Sequences [first, num_seqs) (default: all but the decodes, which come first, one row each)."""
        if first is None:
            first = meta.num_decodes
        start = sum(meta.query_lens_host[:first])  # the first row of sequence `first`
        for i in range(first, meta.num_seqs):
            qlen, slen = meta.query_lens_host[i], meta.seq_lens_host[i]
            end = start + qlen
            qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
            # nothing cached: attend to the new tokens directly (an 8-bit pool's rounded values are read back instead)
            if slen == qlen and not (is_quantized(kv_cache) or is_fp8(kv_cache)):
                ki = k[start:end].transpose(0, 1).unsqueeze(0)
                vi = v[start:end].transpose(0, 1).unsqueeze(0)
            else:
                ki, vi = self._gather(kv_cache, meta.block_tables[i : i + 1], slen)
                qi = qi.to(ki.dtype)
            # query j sits at position slen - qlen + j and sees keys up to that position (and within the window)
            mask = None
            if slen != qlen or (window and window < slen):
                qpos = torch.arange(slen - qlen, slen, device=q.device)[:, None]
                kpos = torch.arange(slen, device=q.device)[None, :]
                mask = kpos <= qpos
                if window:
                    mask &= kpos > qpos - window
                mask = mask.view(1, 1, qlen, slen)
            o = attend(qi, ki, vi, mask, scale, softcap, causal=mask is None)
            out[start:end] = o.squeeze(0).transpose(0, 1).to(q.dtype)
            start = end


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float = 0.0, causal: bool = False) -> torch.Tensor:
    """Attention of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D]: SDPA, or with soft-capping transformers' eager math."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / softcap) * softcap
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)
