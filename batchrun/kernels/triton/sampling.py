"""Every row's token on a GPU without a sort, as model/sampling/sampler.py defines it: each filter's threshold on
e = exp((x - max x) / T) found by bisection over e's bits, then the draw by inverse CDF, block by block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _weights(x_ptr, offs, mask, m, inv_t):
    """e at offs (0 where masked or -inf)."""
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"))
    return tl.where(x == float("-inf"), 0.0, tl.exp((x - m) * inv_t))


@triton.jit
def _mass_at_least(x_ptr, vocab, m, inv_t, lo_bits, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """The count (COUNT) or the sum of the row's e whose bits are >= lo_bits."""
    total = 0.0
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        e = _weights(x_ptr, offs, mask, m, inv_t)
        hit = (e.to(tl.int32, bitcast=True) >= lo_bits) & mask & (e > 0.0)
        if COUNT:
            total += tl.sum(tl.where(hit, 1.0, 0.0), axis=0)
        else:
            total += tl.sum(tl.where(hit, e, 0.0), axis=0)
    return total


@triton.jit
def _largest_threshold(x_ptr, vocab, m, inv_t, floor_bits, target, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """The largest bit pattern b >= floor_bits with (count or mass of e >= b) >= target (floor_bits if none)."""
    lo = floor_bits
    hi = 0x3F800001  # past the bits of 1.0, the largest e
    for _ in range(31):
        if hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if _mass_at_least(x_ptr, vocab, m, inv_t, mid, COUNT, BLOCK) >= target:
                lo = mid
            else:
                hi = mid
    return lo


@triton.jit
def _sample_rows_kernel(logits_ptr, stride, vocab, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, u_ptr, out_ptr,
                        HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_ptr = logits_ptr + row.to(tl.int64) * stride
    # the row's maximum and its first index (a NaN counts as the maximum, as torch's argmax)
    best = float("-inf")
    best_at = vocab
    nan_at = vocab
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < vocab
        x = tl.load(x_ptr + offs, mask=mask, other=float("-inf"))
        nan_at = tl.minimum(nan_at, tl.min(tl.where((x != x) & mask, offs, vocab), axis=0))
        block_max = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
        at = tl.min(tl.where((x == block_max) & mask, offs, vocab), axis=0)
        better = block_max > best
        best_at = tl.where(better, at, best_at)
        best = tl.where(better, block_max, best)
    temperature = tl.load(temp_ptr + row)
    token = tl.where(nan_at < vocab, nan_at, tl.where(best_at < vocab, best_at, 0))
    if (temperature > 0.0) & (nan_at == vocab) & (best > float("-inf")):
        inv_t = 1.0 / temperature
        m = best
        threshold = 1  # bits of the smallest kept e (1: every e > 0)
        if HAS_TOP_K:
            k = tl.load(top_k_ptr + row)
            if (k > 0) & (k < vocab):
                threshold = _largest_threshold(x_ptr, vocab, m, inv_t, 1, k.to(tl.float32), True, BLOCK)
        if HAS_TOP_P:
            p = tl.load(top_p_ptr + row)
            if p < 1.0:
                kept_mass = _mass_at_least(x_ptr, vocab, m, inv_t, threshold, False, BLOCK)
                threshold = _largest_threshold(x_ptr, vocab, m, inv_t, threshold, p * kept_mass, False, BLOCK)
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row)
            if min_p > 0.0:
                threshold = tl.maximum(threshold, min_p.to(tl.int32, bitcast=True))
        # the draw: u x the kept mass, found block by block, then inside the block
        kept_mass = _mass_at_least(x_ptr, vocab, m, inv_t, threshold, False, BLOCK).to(tl.float64)
        target = tl.load(u_ptr + row) * kept_mass
        run = tl.zeros((), dtype=tl.float64)
        drawn = -1
        last = 0
        for start in range(0, vocab, BLOCK):
            if drawn < 0:
                offs = start + tl.arange(0, BLOCK)
                mask = offs < vocab
                e = _weights(x_ptr, offs, mask, m, inv_t)
                kept = (e.to(tl.int32, bitcast=True) >= threshold) & mask & (e > 0.0)
                w = tl.where(kept, e, 0.0)
                block_mass = tl.sum(w, axis=0).to(tl.float64)
                last = tl.maximum(last, tl.max(tl.where(kept, offs, 0), axis=0))
                if run + block_mass > target:
                    inside = run + tl.cumsum(w, axis=0).to(tl.float64)
                    at = tl.min(tl.where((inside > target) & kept, offs, vocab), axis=0)
                    drawn = tl.where(at < vocab, at, last)
                run += block_mass
        token = tl.where(drawn < 0, last, drawn)  # (rounding left the walk short: the last kept)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's contract (batchrun.kernels.cpu.sampling.sample_rows) on the GPU."""
    if logits.stride(-1) != 1 or logits.dtype != torch.float32:
        logits = logits.float().contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    dummy = temperature  # (never read when its flag is off)
    _sample_rows_kernel[(rows,)](
        logits, logits.stride(0), vocab, temperature.float().contiguous(),
        dummy if top_k is None else top_k.to(torch.int32).contiguous(),
        dummy if top_p is None else top_p.float().contiguous(),
        dummy if min_p is None else min_p.float().contiguous(),
        u.to(torch.float64).contiguous(), out,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=min(2048, triton.next_power_of_2(vocab)))
    return out
