"""A sparse MoE block's router choice, weighted sum and gated shared expert (csrc/moe.c), the same calls in the
Python path and the native call."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import dtype_flag

_P, _I, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "moe_route": (None, [_P, _I, _I, _I, _B, _B, _P, _P]),
    "moe_combine": (None, [_P, _P, _P, _P, _I, _I, _I, _P, _B]),
    "moe_add_shared": (None, [_P, _P, _P, _I, _I, _B]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, top_k], experts int64 [N, top_k]) of contiguous router logits [N, E] (moe_route)."""
    rows, experts = logits.shape
    weights = torch.empty(rows, top_k, dtype=torch.float32)
    chosen = torch.empty(rows, top_k, dtype=torch.int64)
    _library().moe_route(logits.data_ptr(), rows, experts, top_k, int(normalize), dtype_flag(logits),
                         weights.data_ptr(), chosen.data_ptr())
    return weights, chosen


def combine(outputs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * outputs[:, j] of contiguous outputs [N, top_k, H] (moe_combine)."""
    rows, top_k, hidden = outputs.shape
    out = torch.empty(rows, hidden, dtype=outputs.dtype)
    _library().moe_combine(outputs.data_ptr(), None, weights.data_ptr(), experts.data_ptr(), rows, top_k, hidden,
                           out.data_ptr(), dtype_flag(outputs))
    return out


def add_shared(out: torch.Tensor, shared: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(gate_logits) * shared, in place on contiguous out, shared [N, H] and gate_logits [N, 1]."""
    rows, hidden = out.shape
    _library().moe_add_shared(out.data_ptr(), shared.data_ptr(), gate_logits.data_ptr(), rows, hidden,
                              dtype_flag(out))
    return out
