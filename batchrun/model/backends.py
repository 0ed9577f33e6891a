"""The choice of attention backend, made once when the runner is built. A module of its own because it
imports every backend, and the backends import the attention contract (attention.py)."""

from __future__ import annotations

import os

import torch

from batchrun.model.attention import AttentionBackend, TorchBackend
from batchrun.model.ops import uses_cpu_kernels


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """`auto` is Triton on CUDA and torch elsewhere; Triton on CPU only under TRITON_INTERPRET=1 (tests).
    The torch backend uses the C kernels for fp32 and bf16 on a CPU when they are built."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend(cpu_kernels=uses_cpu_kernels(device, dtype))
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests); "
                "use 'torch' or 'auto' on CPU"
            )
        from batchrun.model.triton_backend import TritonBackend  # imports triton: only when asked for

        return TritonBackend()
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
