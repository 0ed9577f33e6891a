"""GPTQ's per-input loop over a block of inputs (csrc/gptq.c)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "gptq_block": (None, [_P, _P, _P, _P, _P, _I, _I, _F, _F]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def available() -> bool:
    return _library() is not None


def gptq_block(w_block: torch.Tensor, scale: torch.Tensor, hinv: torch.Tensor, lowest: float, largest: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """w_block [rows, width] (updated in place), scale [rows, width], hinv [width, width], all fp32 contiguous ->
    (the rounded integers, each input's error over its hinv diagonal), both [rows, width]."""
    rows, width = w_block.shape
    q, errors = torch.empty_like(w_block), torch.empty_like(w_block)
    _library().gptq_block(w_block.data_ptr(), scale.data_ptr(), hinv.data_ptr(), q.data_ptr(), errors.data_ptr(),
                          rows, width, lowest, largest)
    return q, errors
