"""Bidirectional attention over packed sequences without padding, for encoders (no KV cache): each sequence's rows
attend to its own rows only, optionally within a local window. One scaled_dot_product_attention per sequence."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def local_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor | None:
    """[length, length] bool, True where |query - key| <= window // 2 (ModernBERT's local layers, as transformers
    masks them); None where every key is within reach."""
    half = window // 2
    if length <= half + 1:
        return None
    pos = torch.arange(length, device=device)
    return (pos[:, None] - pos[None, :]).abs() <= half


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_starts: Sequence[int],
                     scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """q, k, v [tokens, heads, head_dim] of packed sequences, sequence i at rows seq_starts[i]:seq_starts[i + 1]
    (seq_starts: host ints, first 0, last the token count). Returns [tokens, heads, head_dim]. scale: None is
    head_dim ** -0.5. window: each token sees the keys within window // 2 on each side (None: all its sequence's)."""
    if seq_starts[0] != 0 or seq_starts[-1] != q.shape[0]:
        raise ValueError(f"seq_starts must run from 0 to the token count {q.shape[0]}, got {list(seq_starts)}")
    out = torch.empty_like(q)
    for start, end in zip(seq_starts[:-1], seq_starts[1:]):
        if end == start:
            continue
        mask = None if window is None else local_window_mask(end - start, window, q.device)
        # [1, heads, rows, head_dim]: batched inputs take torch's fused CPU kernel, 3-D ones its unfused reference
        o = F.scaled_dot_product_attention(q[None, start:end].transpose(1, 2), k[None, start:end].transpose(1, 2),
                                           v[None, start:end].transpose(1, 2), attn_mask=mask, scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out
