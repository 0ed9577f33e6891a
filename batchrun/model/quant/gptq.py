"""GPTQ (Frantar et al., 2022): weights rounded one input at a time, each error moved onto the inputs not yet rounded
through H = X^T X's inverse, so that X W^T stays close. With H the identity it is round to nearest exactly."""

from __future__ import annotations

import torch

from batchrun.kernels.cpu import gptq as gptq_kernels
from batchrun.kernels.layouts.quant_weight import QuantizedWeight, pack_int4

# Added to H's diagonal, as a share of its mean: keeps the Cholesky factorisation defined where H is singular
# (fewer tokens than inputs, dead inputs), and the rounding from fitting the calibration tokens too closely.
DAMPING = 0.1
# Inputs per lazy update: errors are applied to the columns of the current block at once per input, and to the
# rest of the matrix once per block (one matrix product), as in the paper.
BLOCK = 128


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int,
                  damping: float = DAMPING, act_order: bool = True) -> QuantizedWeight:
    """weight [out, in], hessian [in, in] -> a QuantizedWeight of `bits` in groups of `group_size`. act_order: the
    inputs by H's diagonal, largest first, the group scales fixed beforehand so groups stay contiguous (static groups);
    without it, in order, each group's scale taken as the errors before it left its weights."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ rounds to 4 or 8 bits, not {bits}")
    w = weight.detach().to(torch.float32).clone()
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} inputs do not split into groups of {group_size}")
    h = hessian.detach().to(torch.float32).clone()
    dead = torch.diagonal(h) <= 0  # inputs the calibration never reached: their weights cannot matter to it
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damping * torch.diagonal(h).mean())
    largest = 127.0 if bits == 8 else 7.0
    lowest = -127.0 if bits == 8 else -8.0
    tiny = torch.finfo(torch.float32).tiny
    column_scale = None  # act_order: each input's (fixed) scale, in the order the inputs are rounded
    if act_order:
        scale = w.reshape(out_features, -1, group_size).abs().amax(dim=2).clamp_min(tiny) / largest
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
        column_scale = scale.repeat_interleave(group_size, dim=1)[:, order]
        block = BLOCK
    else:
        scale = torch.empty(out_features, in_features // group_size, dtype=torch.float32)  # set group by group
        order = torch.arange(in_features)
        block = group_size * max(1, BLOCK // group_size)  # a group never straddles two blocks
    # The upper Cholesky factor of H^-1: its row i, over its diagonal, is how rounding input i spreads onto the
    # inputs after it (the paper's equivalent of updating H^-1 after each input).
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty(out_features, in_features, dtype=torch.float32)
    in_c = column_scale is not None and gptq_kernels.available()
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        w_block = w[:, start:end].clone()
        hinv_block = hinv[start:end, start:end]
        if in_c:  # the same loop in C, row by row (csrc/gptq.c)
            q[:, start:end], errors = gptq_kernels.gptq_block(
                w_block, column_scale[:, start:end].contiguous(), hinv_block.contiguous(), lowest, largest)
            w[:, end:].sub_(errors @ hinv[start:end, end:])
            continue
        errors = torch.empty_like(w_block)
        for i in range(end - start):
            column = start + i
            if column_scale is not None:
                input_scale = column_scale[:, column]
            elif column % group_size == 0:
                input_scale = w_block[:, i : i + group_size].abs().amax(dim=1).clamp_min(tiny) / largest
                scale[:, column // group_size] = input_scale
            rounded = torch.round(w_block[:, i] / input_scale).clamp_(lowest, largest)
            q[:, column] = rounded
            error = (w_block[:, i] - rounded * input_scale) / hinv_block[i, i]
            w_block[:, i + 1 :].addr_(error, hinv_block[i, i + 1 :], alpha=-1.0)  # in place: no temporary
            errors[:, i] = error
        w[:, end:].sub_(errors @ hinv[start:end, end:])
    q = q[:, torch.argsort(order)]  # back to the inputs' own order
    if bits == 8:
        return QuantizedWeight(8, q.to(torch.int8), scale, None, group_size)
    return QuantizedWeight(4, pack_int4(q + 8.0), scale, -8.0 * scale, group_size)


def split_rows(weight: QuantizedWeight, rows: list[int]) -> list[QuantizedWeight]:
    """A QuantizedWeight of stacked linears (q|k|v rounded with their shared H) back into one per linear."""
    parts, start = [], 0
    for n in rows:
        offset = None if weight.offset is None else weight.offset[start : start + n]
        parts.append(QuantizedWeight(weight.bits, weight.qweight[start : start + n], weight.scale[start : start + n],
                                     offset, weight.group_size))
        start += n
    return parts
