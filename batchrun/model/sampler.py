"""Logits -> next tokens, vectorized over the batch.

Randomness is counter-based: the uniform number a sequence draws at output position t is a hash of
(its seed, t), computed for all rows in one tensor op. So a request's samples depend only on its own seed,
never on what else shares the batch, and no per-request generator object is kept or looped over. Tokens
are drawn by inverse CDF over the processed distribution.

Every op here is per row and exact whatever the batch: torch's CPU softmax, log_softmax, sort, cumsum, argmax
and topk over a [rows, vocab] tensor give each row the bits it gets alone (measured, and held by
tests/test_batch_invariance.py), and an option another row turns on (top-k, top-p, min-p, penalties) is the
identity on a row that leaves it off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _s64(x: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift on int64."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform float64 in [0, 1) per row, a pure function of (seed, counter)."""
    z = _splitmix(_splitmix(seeds) ^ counters)
    return _shr(z, 11).double() * (1.0 / (1 << 53))


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device."""

    # greedy, temperature, seeds and counters are None when every row is greedy (argmax needs none of them)
    greedy: torch.Tensor | None  # bool [B]
    temperature: torch.Tensor | None  # float [B] (1.0 on greedy rows)
    top_k: torch.Tensor | None  # int [B], 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # float [B]
    min_p: torch.Tensor | None  # float [B]
    seeds: torch.Tensor | None  # int64 [B]
    counters: torch.Tensor | None  # int64 [B]: output position of the token being drawn
    all_greedy: bool
    # penalties (None when no row uses any)
    repetition: torch.Tensor | None = None  # float [B]
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # bool [B, V]: token appears in the prompt
    output_counts: torch.Tensor | None = None  # float [B, V]: times the token appears in the output
    # rows that may not stop yet (min_tokens): (row indices, token ids to ban there)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    max_logprobs: int = 0  # the largest SamplingParams.logprobs among the rows (-1 = none asked)
    want_logprobs: bool = False


@dataclass
class SamplerResult:
    tokens: torch.Tensor  # int64 [B]
    logprob: torch.Tensor | None  # float [B]: raw logprob of the chosen token
    top_ids: torch.Tensor | None  # int64 [B, N]
    top_logprobs: torch.Tensor | None  # float [B, N]


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """HF-style repetition penalty over prompt and output tokens; OpenAI-style presence and frequency
    penalties over output tokens."""
    seen = b.prompt_mask | (b.output_counts > 0)
    rep = b.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - b.frequency[:, None] * b.output_counts
    return logits - b.presence[:, None] * (b.output_counts > 0).float()


def _mask_top_k_top_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.top_k is not None:
        k = torch.where(b.top_k > 0, b.top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        remove |= sorted_logits < kth
    if b.top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        # top_p = 1 is off: its row keeps every token. (`before >= 1` is true at the tail once the fp32
        # cumsum rounds up to 1, which would drop tokens of a top_p = 1 row only when another row of its
        # batch uses top_p: its draw would depend on its batch.)
        limit = b.top_p.masked_fill(b.top_p >= 1, float("inf"))
        remove |= before >= limit[:, None]
        remove[:, 0] = False
    return logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))


_CHUNK = 64  # columns per chunk in argmax_rows (a vocabulary padded to a multiple of 64 divides)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for a 2-D tensor, the same indices (the first maximum; NaN counts as the maximum).

    On CPU torch's index-returning reductions run a scalar loop (about 5 ns an element: 2 ms for 256 rows
    of a 2k vocabulary, most of a greedy decode step's time outside the model), while amax is vectorized.
    So: the max of each chunk of _CHUNK columns with amax, the first chunk holding the row's maximum (or
    a NaN; found the same way, over the chunks), and argmax only inside that chunk. On CUDA, or for a
    width that does not divide, plain argmax."""
    rows, width = x.shape
    if x.device.type != "cpu" or width % _CHUNK or width <= _CHUNK or rows == 0:
        return x.argmax(dim=-1)
    chunks = x.reshape(rows, width // _CHUNK, _CHUNK)
    chunk_max = chunks.amax(dim=-1)  # [rows, num chunks]
    row_max = chunk_max.amax(dim=-1, keepdim=True)  # NaN where the row has one
    holds = (chunk_max == row_max) | chunk_max.isnan()
    first = argmax_rows(holds.to(torch.float32))  # the first chunk that holds it
    num_chunks = width // _CHUNK
    picked = chunks.reshape(rows * num_chunks, _CHUNK).index_select(0, torch.arange(rows) * num_chunks + first)
    return first * _CHUNK + picked.argmax(dim=-1)  # argmax over [rows, _CHUNK]


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerResult:
    """logits: float32 [B, V]. One pass: penalties, bans, greedy argmax, and for the other rows
    temperature, top-k / top-p / min-p and an inverse-CDF draw."""
    raw = logits
    if b.repetition is not None:
        logits = apply_penalties(logits, b)
    if b.banned is not None:
        rows, ids = b.banned
        logits = logits.index_put((rows, ids), torch.tensor(float("-inf"), device=logits.device))
    tokens = argmax_rows(logits)
    if not b.all_greedy:
        x = logits / b.temperature[:, None]
        if b.top_k is not None or b.top_p is not None:
            x = _mask_top_k_top_p(x, b)
        probs = x.softmax(dim=-1)
        if b.min_p is not None:
            keep = probs >= b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        cdf = probs.double().cumsum(dim=-1)
        u = uniform(b.seeds, b.counters) * cdf[:, -1]
        drawn = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)
        # guard against rounding at the top end landing on a token with no mass
        ok = probs.gather(1, drawn[:, None]).squeeze(1) > 0
        drawn = torch.where(ok, drawn, probs.argmax(dim=-1))
        tokens = torch.where(b.greedy, tokens, drawn)
    if not b.want_logprobs:
        return SamplerResult(tokens, None, None, None)
    logp = raw.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    if b.max_logprobs > 0:
        top_lp, top_ids = logp.topk(b.max_logprobs, dim=-1)
    else:
        top_lp = top_ids = None
    return SamplerResult(tokens, chosen, top_ids, top_lp)
