"""Kernels on a step's logits on a CPU (csrc/sampling.c): the bf16 logits' widening with each row's top k
(llama.py's lm_head), the structured outputs' token mask (grammar_mask.py) and the rows' tokens (sampler.py)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "logits_top": (None, [_P, _P, _I, _I, _I, _P]),
    "apply_token_bitmask": (None, [_P, _I, _P, _I, _P, _I, _I]),
    "sample_rows": (_INT, [_P, _I, _I, _I, _P, _P, _P, _P, _P, _P]),
    "sample_weights": (_INT, [_P, _I, _I, _P, _P, _P, _P, _P, _P]),
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


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Every row's token (int64 [rows]) from fp32 logits [rows, vocab] (rows contiguous): the first maximum
    where temperature (float32 [rows]) is 0, else a draw with the row's uniform u (float64 [rows]) through its
    top_k (int64, 0 off), top_p (float32, 1 off) and min_p (float32, 0 off) filters; None: off for every row.
    The kept set and the draw are model/sampling/sampler.py's definition, found without a sort (csrc/sampling.c)."""
    if logits.stride(-1) != 1 or logits.dtype != torch.float32:
        logits = logits.float().contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    ptr = [None if t is None else t.contiguous() for t in (top_k, top_p, min_p)]
    if _library().sample_rows(logits.data_ptr(), logits.stride(0), rows, vocab, temperature.contiguous().data_ptr(),
                              *(None if t is None else t.data_ptr() for t in ptr), u.contiguous().data_ptr(),
                              out.data_ptr()):
        raise MemoryError("sample_rows: no memory for a thread's row buffers")
    return out


def sample_weights(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_rows' filters and draw on given weights (fp32 [rows, vocab] >= 0, no exp between; min_p relative to
    each row's largest weight): (tokens int64 [rows], each row's kept-set threshold float32 [rows]). For tests."""
    w = weights.float().contiguous()
    rows, vocab = w.shape
    out = torch.empty(rows, dtype=torch.int64)
    threshold = torch.empty(rows, dtype=torch.float32)
    if _library().sample_weights(w.data_ptr(), rows, vocab, top_k.contiguous().data_ptr(),
                                 top_p.contiguous().data_ptr(), min_p.contiguous().data_ptr(),
                                 u.contiguous().data_ptr(), out.data_ptr(), threshold.data_ptr()):
        raise MemoryError("sample_weights: no memory for the row buffers")
    return out, threshold
