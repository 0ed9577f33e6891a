"""Kernels on a step's logits (csrc/sampling.c): top-k of bf16 logits, the grammar's token mask, sampling."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "logits_top": (None, [_P, _P, _I, _I, _I, _P]),
    "logits_top_row": (None, [_P, _P, _I, _I, _P]),  # (logits.c's sample_bf16 calls these two per row)
    "sample_logits_row": (ctypes.c_int64, [_P, _I, ctypes.c_float, _I, ctypes.c_float, ctypes.c_float,
                                           ctypes.c_double]),
    "apply_token_bitmask": (None, [_P, _I, _P, _I, _P, _I, _I]),
    "sample_rows": (_INT, [_P, _I, _I, _I, _P, _P, _P, _P, _P, _P]),
    "sample_weights": (_INT, [_P, _I, _I, _P, _P, _P, _P, _P, _P]),
    "score_rows": (None, [_P, _I, _I, _I, _P, _I, _P, _P, _P, _P]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def logits_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits [N, V] -> (them in fp32, int64 [N, k] indices of each row's k largest, by value descending
    then index); k <= 64."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, vocab, dtype=torch.float32)
    top = torch.empty(n, k, dtype=torch.int64)
    _library().logits_top(logits.data_ptr(), out.data_ptr(), n, vocab, k, top.data_ptr())
    return out, top


MAX_SCORED_TOP = 64


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """fp32 logits [R, V] (unit stride in V) and a token per row -> its log-probability (float32 [R]) and rank
    (int64 [R], 1 + the tokens more likely), and the k <= MAX_SCORED_TOP most likely (log-probs, ids) [R, k],
    largest first (None, None when k is 0); sampler.score_rows' definition."""
    rows, vocab = logits.shape
    targets = targets.to(torch.int64).contiguous()
    logprob, rank = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.int64)
    top_lp = torch.empty(rows, k, dtype=torch.float32) if k else None
    top_ids = torch.empty(rows, k, dtype=torch.int64) if k else None
    _library().score_rows(logits.data_ptr(), logits.stride(0), rows, vocab, targets.data_ptr(), k,
                          logprob.data_ptr(), rank.data_ptr(), top_lp.data_ptr() if k else None,
                          top_ids.data_ptr() if k else None)
    return logprob, rank, top_lp, top_ids


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """In place, for the listed rows of fp32 logits: -inf where the int32 bitmask (xgrammar's layout: bit t % 32 of
    word t // 32) has token t off."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1 or logits.dtype != torch.float32:
        raise ValueError("apply_token_bitmask takes fp32 logits and an int32 bitmask with contiguous rows")
    index = torch.tensor(rows, dtype=torch.int64)
    _library().apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                   index.data_ptr(), len(rows), min(vocab, logits.shape[-1], 32 * bitmask.shape[-1]))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """int64 [rows] tokens from fp32 logits: the first maximum where temperature is 0, else u's (float64) draw
    through top_k (0 off), top_p (1 off), min_p (0 off), None: off for all rows; sampler.py's definition, unsorted."""
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
    """For tests: sample_rows' draw on weights >= 0 (no exp) -> (tokens, each row's kept-set threshold)."""
    w = weights.float().contiguous()
    rows, vocab = w.shape
    out = torch.empty(rows, dtype=torch.int64)
    threshold = torch.empty(rows, dtype=torch.float32)
    if _library().sample_weights(w.data_ptr(), rows, vocab, top_k.contiguous().data_ptr(),
                                 top_p.contiguous().data_ptr(), min_p.contiguous().data_ptr(),
                                 u.contiguous().data_ptr(), out.data_ptr(), threshold.data_ptr()):
        raise MemoryError("sample_weights: no memory for the row buffers")
    return out, threshold
