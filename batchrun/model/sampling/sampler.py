"""Logits -> next tokens, every op per row: a row's token never depends on its batch. The uniform a sequence draws at
output position t is a hash of (its seed, t): the same for a decode row, a checked draft or after a preemption.
A sampled row draws by inverse CDF, in token id order, over e_i = exp((x_i - max x) / T) among the tokens past its
thresholds on e (ties kept): top-k the k-th largest e; top-p the largest t with sum(e_i >= t) >= top_p x the mass
top-k left; min-p min_p. The kernels find the thresholds without sorting; draw_reference is the sorted definition."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import sampling as cpu_sampling
from batchrun.model.sampling.batch import SamplingBatch

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
class SamplerResult:
    tokens: torch.Tensor  # int64 [B]
    logprob: torch.Tensor | None  # float [B]: raw logprob of the chosen token
    top_ids: torch.Tensor | None  # int64 [B, N]
    top_logprobs: torch.Tensor | None  # float [B, N]
    rank: torch.Tensor | None = None  # int64 [B]: the chosen token's rank by raw logprob (1: the most likely)


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """HF-style repetition penalty (prompt and output tokens); OpenAI-style presence and frequency (output)."""
    seen = b.prompt_mask | (b.output_counts > 0)
    rep = b.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - b.frequency[:, None] * b.output_counts
    return logits - b.presence[:, None] * (b.output_counts > 0).float()


def draw_reference(logits: torch.Tensor, b: SamplingBatch, u: torch.Tensor) -> torch.Tensor:
    """The kernels' draw by the sorted definition: the path without them, and the tests' reference."""
    tokens = argmax_rows(logits)
    sampled = (b.temperature > 0).nonzero().squeeze(1)
    if sampled.numel() == 0:
        return tokens
    x = logits.index_select(0, sampled).float()
    rows, vocab = x.shape
    inv_t = 1.0 / b.temperature.index_select(0, sampled).float()
    e = torch.exp((x - x.amax(dim=-1, keepdim=True)) * inv_t[:, None]).masked_fill(x == float("-inf"), 0.0)
    ordered = e.sort(dim=-1, descending=True).values
    threshold = torch.zeros(rows, dtype=torch.float32, device=e.device)
    mass = e.double().sum(-1)
    if b.top_k is not None:
        k = b.top_k.index_select(0, sampled)
        on = (k > 0) & (k < vocab)
        kth = ordered.gather(1, (k.clamp(1, vocab) - 1)[:, None]).squeeze(1)
        threshold = torch.where(on, kth, threshold)
        mass = (e * (e >= threshold[:, None])).double().sum(-1)
    if b.top_p is not None:
        p = b.top_p.index_select(0, sampled)
        kept = ordered * (ordered >= threshold[:, None])
        prefix = kept.double().cumsum(-1)
        # the first position whose prefix mass reaches top_p x mass (past the end by rounding: the last)
        at = torch.searchsorted(prefix, (p.double() * mass)[:, None]).clamp(max=vocab - 1)
        t_p = kept.gather(1, at).squeeze(1)
        threshold = torch.where(p < 1, torch.maximum(threshold, t_p), threshold)
    if b.min_p is not None:
        threshold = torch.maximum(threshold, b.min_p.index_select(0, sampled).float())
    weights = (e * ((e >= threshold[:, None]) & (e > 0))).double()
    cdf = weights.cumsum(-1)
    target = u.index_select(0, sampled).double() * cdf[:, -1]
    drawn = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=vocab - 1).squeeze(1)
    # rounding at the top end can land past the last kept token: take that token
    last_kept = vocab - 1 - (weights > 0).flip(-1).int().argmax(-1)
    drawn = torch.where(weights.gather(1, drawn[:, None]).squeeze(1) > 0, drawn, last_kept)
    return tokens.index_copy(0, sampled, drawn)


def draw(logits: torch.Tensor, b: SamplingBatch, u: torch.Tensor) -> torch.Tensor:
    """Every row's token: greedy rows their argmax, sampled rows a draw with their uniform u (float64 [B])."""
    if logits.device.type == "cpu" and cpu_kernels.available():
        return cpu_sampling.sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, u)
    if logits.device.type == "cuda":
        from batchrun.kernels.triton.sampling import sample_rows

        return sample_rows(logits, b.temperature, b.top_k, b.top_p, b.min_p, u)
    return draw_reference(logits, b, u)


_CHUNK = 64  # columns per chunk in argmax_rows (a vocabulary padded to a multiple of 64 divides)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), NaN a maximum; on a CPU amax per _CHUNK columns, argmax only in the chunk holding it."""
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
    """logits: float32 [B, V]. Penalties, bans, then the greedy argmax or, when some row samples, draw()."""
    raw = logits
    if b.repetition is not None:
        logits = apply_penalties(logits, b)
    if b.banned is not None:
        rows, ids = b.banned
        logits = logits.index_put((rows, ids), torch.tensor(float("-inf"), device=logits.device))
    if b.all_greedy:
        tokens = argmax_rows(logits)
    else:
        tokens = draw(logits, b, uniform(b.seeds, b.counters))
    if not b.want_logprobs:
        return SamplerResult(tokens, None, None, None)
    chosen, rank, top_lp, top_ids = score_rows(raw, tokens, b.max_logprobs)
    return SamplerResult(tokens, chosen, top_ids, top_lp, rank)


def score_rows(logits: torch.Tensor, targets: torch.Tensor, num_top: int):
    """float32 logits [R, V] and a token per row -> its log-probability and rank (1 + the tokens more likely), and
    the num_top most likely (log-probs, ids) of each row, largest first (None when num_top is 0). On a CPU the C
    kernel reads each row in cache instead of writing a [R, V] log_softmax."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and num_top <= cpu_sampling.MAX_SCORED_TOP and cpu_kernels.available()):
        return cpu_sampling.score_rows(logits, targets, num_top)
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, targets[:, None])
    rank = (logits > logits.gather(1, targets[:, None])).sum(dim=-1) + 1  # the logits: rounding cannot tie them
    top_lp, top_ids = logp.topk(num_top, dim=-1) if num_top > 0 else (None, None)
    return chosen.squeeze(1), rank, top_lp, top_ids
