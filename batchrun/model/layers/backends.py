"""The attention backend, chosen once per runner, and whether the engine runs batch invariant."""

from __future__ import annotations

import logging
import os

import torch

from batchrun.model.layers.attention import AttentionBackend, TorchBackend
from batchrun.model.layers.ops import uses_cpu_kernels

log = logging.getLogger(__name__)


def resolve_batch_invariant(setting: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """None: on for float32 on a CPU; off for bfloat16 (slower invariant linears at prefill) and on CUDA (cuBLAS
    is not invariant). True where the linears cannot hold it warns once."""
    if setting is None:
        return device.type == "cpu" and dtype == torch.float32
    if setting and device.type != "cpu":
        log.warning("batch_invariant on %s: attention is batch invariant (the Triton decode kernel does not "
                    "split the context) but the linears are cuBLAS's, whose kernels change with the number of "
                    "rows, so a row's logits can still depend on its batch", device.type)
    elif setting and dtype not in (torch.float32, torch.bfloat16):
        log.warning("batch_invariant with %s on a CPU: only float32 and bfloat16 have batch-invariant linears",
                    str(dtype).removeprefix("torch."))
    return setting


def select_backend(name: str, device: torch.device, dtype: torch.dtype,
                   batch_invariant: bool = False) -> AttentionBackend:
    """`auto`: Triton on CUDA, torch elsewhere (C kernels for fp32 / bf16 on a CPU); Triton on a CPU only in tests."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        kernels = uses_cpu_kernels(device, dtype)
        return TorchBackend(cpu_kernels=kernels, batch_invariant=batch_invariant)
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests); "
                "use 'torch' or 'auto' on CPU"
            )
        from batchrun.model.layers.triton_backend import TritonBackend  # imports triton: only when asked for

        return TritonBackend(split_context=not batch_invariant)
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
