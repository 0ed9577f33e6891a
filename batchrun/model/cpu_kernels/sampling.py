"""Kernels on a step's logits on a CPU (csrc/sampling.c): the bf16 logits' widening with each row's top k
(llama.py's lm_head) and the structured outputs' token mask (grammar_mask.py). A new sampling kernel goes in
csrc/sampling.c, with its signature in SIGNATURES and its wrapper here."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.model import cpu_kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "logits_top": (None, [_P, _P, _I, _I, _I, _P]),
    "apply_token_bitmask": (None, [_P, _I, _P, _I, _P, _I, _I]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def logits_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits [N, V] -> (the same in fp32, int64 [N, k] indices of each row's k largest, in no order);
    k <= 64."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, vocab, dtype=torch.float32)
    top = torch.empty(n, k, dtype=torch.int64)
    _library().logits_top(logits.data_ptr(), out.data_ptr(), n, vocab, k, top.data_ptr())
    return out, top


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """logits fp32 [N, >= vocab] (rows contiguous), in place: -inf where the int32 bitmask [>= N, words]
    (xgrammar's layout: bit t % 32 of word t // 32) has token t off, for the listed rows only."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1 or logits.dtype != torch.float32:
        raise ValueError("apply_token_bitmask takes fp32 logits and an int32 bitmask with contiguous rows")
    index = torch.tensor(rows, dtype=torch.int64)
    _library().apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                   index.data_ptr(), len(rows), min(vocab, logits.shape[-1], 32 * bitmask.shape[-1]))
