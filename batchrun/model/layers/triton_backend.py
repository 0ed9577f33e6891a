"""The CUDA attention backend on the Triton kernels. `forward` reads no device value on the host, so a decode step
can be captured in a CUDA graph (with max_seq_len the longest context it replays); on a CPU only in tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchrun.kernels.triton import copy_blocks as _copy_blocks_kernel
from batchrun.kernels.triton import paged_decode_attention, paged_prefill_attention, store_kv
from batchrun.model.layers.attention import AttentionBackend, AttentionMetadata


class TritonBackend(AttentionBackend):
    """`partition_size`: the context of one decode program before the split (flash-decoding) path.
    `split_context=False` never splits: a decode row then reduces in the prefill kernel's tiles, as every path does."""

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
    """Copy-on-write copies, every layer's K and V, in one launch; no block both a source and a destination."""
    if not isinstance(pairs, torch.Tensor):
        pairs = torch.tensor(list(pairs), dtype=torch.int64).view(-1, 2)
    if pairs.numel() == 0:
        return
    _copy_blocks_kernel(kv_cache_full, pairs.to(kv_cache_full.device, non_blocking=True))
