"""The CUDA attention backend: the Triton kernels of `batchrun/kernels/` behind the `AttentionBackend` contract.

A step's flat batch is decodes first, then prefill / extend chunks (see attention.py), so the decode kernel
gets the leading rows and the prefill kernel the rest, each writing its rows of one output tensor. Nothing in
`forward` reads a device value on the host, so a decode-only step can be captured in a CUDA graph (build the
capture metadata with `max_seq_len` = the longest context the graph will replay, e.g. max_model_len).

On CPU these kernels only run under TRITON_INTERPRET=1 (tests); `backends.select_backend` refuses otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchrun.kernels.triton import copy_blocks as _copy_blocks_kernel
from batchrun.kernels.triton import paged_decode_attention, paged_prefill_attention, store_kv
from batchrun.model.layers.attention import AttentionBackend, AttentionMetadata


class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels.

    `partition_size` is the context length one decode program covers before the split (flash-decoding) path
    kicks in; 512 keeps an H100/H200 busy at small batch without costing much at large batch. Tests lower it
    to reach the split path with short contexts. `split_context=False` (the batch-invariant mode) never
    splits: a decode row then reduces over its context in the prefill kernel's order (same BLOCK_N tiles from
    position 0), so decode, prefill, chunked prefill and prefix-cache hits compute a query row alike.
    """

    name = "triton"

    def __init__(self, partition_size: int = 512, decode_block_n: int = 64, prefill_block_m: int = 64,
                 prefill_block_n: int = 64, split_context: bool = True) -> None:
        if not split_context and decode_block_n != prefill_block_n:
            raise ValueError("an unsplit decode matches prefill only with decode_block_n == prefill_block_n")
        self.partition_size = partition_size if split_context else None
        self.decode_block_n = decode_block_n
        self.prefill_block_m = prefill_block_m
        self.prefill_block_n = prefill_block_n

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, meta.max_seq_len,
                out=out[:nd], partition_size=self.partition_size, block_n=self.decode_block_n, window=window,
                softcap=softcap,
            )
        if nd < meta.num_seqs:
            # query_start_loc[nd:] still holds offsets into the full q/out, which is what the kernel takes.
            paged_prefill_attention(
                q, kv_cache, meta.block_tables[nd:], meta.seq_lens[nd:], meta.query_start_loc[nd:],
                meta.max_query_len, scale, out=out, block_m=self.prefill_block_m, block_n=self.prefill_block_n,
                window=window, softcap=softcap,
            )
        return out


def copy_blocks(kv_cache_full: torch.Tensor, pairs: torch.Tensor | Sequence[tuple[int, int]]) -> None:
    """Copy-on-write copies for one step: every layer, K and V, all pairs in one launch.

    kv_cache_full: the whole device pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    (contiguous); pairs: (src, dst) physical block ids, an int [N, 2] tensor or a list of pairs. No block may
    be both a source and a destination in one call.
    """
    if not isinstance(pairs, torch.Tensor):
        pairs = torch.tensor(list(pairs), dtype=torch.int64).view(-1, 2)
    if pairs.numel() == 0:
        return
    _copy_blocks_kernel(kv_cache_full, pairs.to(kv_cache_full.device, non_blocking=True))
