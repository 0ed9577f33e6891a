"""Grouped GEMM for mixture-of-experts layers: moe_align lays each expert's (token, expert) pairs out in tiles
of its own, without a sync (launches sized by tiles_bound: graph-capturable), and grouped_gemm runs every tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchrun.kernels.triton._common import dot_dtype, dot_precision


def tiles_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles `num_pairs` pairs can need (each expert's rows rounded up to whole tiles)."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def moe_align(expert_of_pair: torch.Tensor, num_experts: int, block_m: int):
    """expert_of_pair int [P] (pair p: token p // top_k) -> (pair_of_row int64 [R], -1 padding; row_of_pair
    int64 [P]; tile_expert int32 [R / block_m], -1 unused), R = tiles_bound * block_m; pairs keep their order."""
    device = expert_of_pair.device
    num_pairs = expert_of_pair.shape[0]
    num_tiles = tiles_bound(num_pairs, num_experts, block_m)
    experts = expert_of_pair.long()
    order = torch.sort(experts, stable=True).indices  # pairs by expert, by token within one
    # not bincount: on CUDA it reads the largest id back (a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, experts,
                                                                                     torch.ones_like(experts))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)  # each expert's tiles end here (exclusive)
    first_row = (tile_end - tiles) * block_m  # an expert's first laid-out row
    first_pair = torch.cumsum(counts, 0) - counts  # an expert's first pair in `order`
    sorted_experts = experts[order]
    rank = torch.arange(num_pairs, device=device) - first_pair[sorted_experts]
    row_of_sorted = first_row[sorted_experts] + rank
    pair_of_row = torch.full((num_tiles * block_m,), -1, dtype=torch.int64, device=device)
    pair_of_row[row_of_sorted] = order
    row_of_pair = torch.empty(num_pairs, dtype=torch.int64, device=device)
    row_of_pair[order] = row_of_sorted
    tile_expert = torch.searchsorted(tile_end, torch.arange(num_tiles, device=device), right=True).to(torch.int32)
    tile_expert = torch.where(tile_expert < num_experts, tile_expert, -1)
    return pair_of_row, row_of_pair, tile_expert


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, rows_ptr, tile_expert_ptr,
    N, K,
    stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)
    m_mask = rows >= 0
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        b = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=DOT_PREC)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def grouped_gemm(x: torch.Tensor, rows: torch.Tensor, tile_expert: torch.Tensor, weight: torch.Tensor, *,
                 block_m: int = 64, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """out [R, N] (x's dtype, fp32 sums): out[r] = x[rows[r]] @ weight[tile_expert[r // block_m]]^T where rows[r] >= 0
    (padding rows unwritten). x [M, K]; rows int64 [R], whole tiles; tile_expert int32, -1 skips; weight [E, N, K]."""
    num_rows = rows.shape[0]
    if num_rows % block_m or tile_expert.shape[0] != num_rows // block_m:
        raise ValueError("rows must hold whole tiles of block_m rows, one expert per tile")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_experts, n, k = weight.shape
    if weight.stride(2) != 1:
        weight = weight.contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    _grouped_gemm_kernel[(num_rows // block_m, triton.cdiv(n, block_n))](
        x, weight, out, rows, tile_expert, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype(weight.dtype), DOT_PREC=dot_precision(weight.dtype),
    )
    return out


def grouped_gemm_ref(x: torch.Tensor, rows: torch.Tensor, tile_expert: torch.Tensor, weight: torch.Tensor,
                     block_m: int) -> torch.Tensor:
    """Row by row in fp64, for tests (padding rows are zero)."""
    out = torch.zeros(rows.shape[0], weight.shape[1], dtype=torch.float64, device=x.device)
    for r, src in enumerate(rows.tolist()):
        if src >= 0:
            out[r] = weight[int(tile_expert[r // block_m])].double() @ x[src].double()
    return out.to(x.dtype)
