"""Copy-on-write block copies, every layer, K and V, for a batch of (src, dst) pairs in one launch; the pairs run
in parallel, so no block may be both a source and a destination in one call (the block manager's are fresh)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.layouts.kv_rows import as_bytes


@triton.jit
def _copy_blocks_kernel(cache_ptr, pairs_ptr, stride_lkv, stride_b, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    layer_kv = tl.program_id(1).to(tl.int64)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    base = cache_ptr + layer_kv * stride_lkv
    for off in range(0, BLOCK_NUMEL, CHUNK):
        offs = off + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(base + dst * stride_b + offs, tl.load(base + src * stride_b + offs, mask=mask), mask=mask)


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """kv_cache: the whole pool [num_layers, 2, num_blocks, ...], contiguous; pairs: integer [N, 2] (src, dst)."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if pairs.numel() == 0:
        return
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be [N, 2] (src, dst), got {tuple(pairs.shape)}")
    pairs = pairs.contiguous()
    num_layers, _, num_blocks = kv_cache.shape[:3]
    flat = as_bytes(kv_cache).view(num_layers * 2, num_blocks, -1)
    block_numel = flat.shape[2]
    _copy_blocks_kernel[(pairs.shape[0], num_layers * 2)](
        flat, pairs, flat.stride(0), flat.stride(1),
        BLOCK_NUMEL=block_numel, CHUNK=min(4096, triton.next_power_of_2(block_numel)),
    )


def copy_blocks_ref(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Pair by pair, for tests."""
    for src, dst in pairs.tolist():
        kv_cache[:, :, dst] = kv_cache[:, :, src]
