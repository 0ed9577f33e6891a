"""How many KV blocks fit: from an explicit count, a byte budget, or (CUDA) a profiled share of the GPU."""

from __future__ import annotations

import logging
import os
import re

import torch

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# CPU default when neither num_kv_blocks nor kv_cache_memory is given: 2 GiB, or an eighth of the
# machine's memory if that is less. The pool is zeroed at start-up, so it is resident from the start.
CPU_DEFAULT_KV_BYTES = 2 * 2**30


def parse_size(value: int | str | None, name: str) -> int | None:
    """Bytes from an int or a string like '2GiB', '512MiB', '1.5GB'."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be a byte count or a size like '2GiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return n


def cpu_default_bytes() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    return min(CPU_DEFAULT_KV_BYTES, total // 8)


def profile_cuda_kv_bytes(runner_factory, device: torch.device, utilization: float,
                          max_num_batched_tokens: int) -> int:
    """Bytes the KV pool may take on CUDA: the utilization share of the GPU, less what the weights and
    a peak forward at the step-token budget use (measured with a throw-away one-block-per-seq pool)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free0, total = torch.cuda.mem_get_info(device)
    runner_factory().profile_forward(max_num_batched_tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_by_others = total - free0 - torch.cuda.memory_allocated(device)
    budget = int(total * utilization) - used_by_others - peak
    torch.cuda.empty_cache()
    log.info("CUDA memory: total %.1f GiB, weights+activations peak %.2f GiB, KV budget %.2f GiB",
             total / 2**30, peak / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} leaves no room for the KV cache "
                         f"(peak use {peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB)")
    return budget
