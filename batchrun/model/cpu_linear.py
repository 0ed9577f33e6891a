"""Linear layers on oneDNN's blocked weight layout, for fp32 models on a CPU whose weights do not stay in cache.

A decode step multiplies a handful of rows by every weight matrix. When the weights are larger than the
caches, each step streams them from memory, and MKL's plain sgemm (what `F.linear` calls) reads them far
below the memory bandwidth for 4 to 64 rows: measured here on the 125M-parameter built-in model, a step of
8-15 sequences took 61 ms with MKL and 37 ms on weights reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn`, the ops torch's own inductor uses on CPU), with prefill unchanged and the greedy
outputs of all 64 benchmark requests identical. On weights that stay in cache (the 11M-parameter model)
oneDNN's per-call cost makes it ~4% slower end to end, so `auto` reorders only models whose linear
weights exceed ONEDNN_MIN_BYTES. The reordered copy replaces the original: memory is unchanged.

BATCHRUN_CPU_MATMUL=mkl|onednn|auto (default auto) overrides the choice.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

ONEDNN_MIN_BYTES = 256 * 2**20
_BATCH_HINT = 128  # the row count oneDNN plans the layout for; any row count works with it


class OneDNNLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (an opaque mkldnn tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, module) of every nn.Linear whose weight is not shared with another module."""
    tied = getattr(getattr(model, "embed_tokens", None), "weight", None)
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child.weight is not tied:
                out.append((parent, name, child))
    return out


def _works(linear: nn.Linear) -> bool:
    """One reordered forward agrees with F.linear (the ops are private to torch: check before relying on them)."""
    try:
        x = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        return torch.allclose(OneDNNLinear(linear)(x), F.linear(x, linear.weight, linear.bias), atol=1e-4, rtol=1e-4)
    except (RuntimeError, AttributeError) as e:
        log.info("oneDNN linear unavailable (%s); using MKL", e)
        return False


def use_onednn(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    choice = os.environ.get("BATCHRUN_CPU_MATMUL", "auto")
    if choice not in ("auto", "mkl", "onednn"):
        raise ValueError(f"BATCHRUN_CPU_MATMUL must be auto, mkl or onednn, got {choice!r}")
    if device.type != "cpu" or dtype != torch.float32 or choice == "mkl" or not torch.backends.mkldnn.is_available():
        return False
    linears = _linears(model)
    if not linears:
        return False
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for _, _, m in linears)
    return (choice == "onednn" or weight_bytes >= ONEDNN_MIN_BYTES) and _works(linears[0][2])


def reorder_linears(model: nn.Module) -> int:
    """Replace every unshared nn.Linear by a OneDNNLinear; returns how many."""
    linears = _linears(model)
    for parent, name, linear in linears:
        setattr(parent, name, OneDNNLinear(linear))
    return len(linears)
