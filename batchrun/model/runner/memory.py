"""What a job takes and what the machine has: the KV pool's size, the refusal before loading of a model that cannot
fit, whether the bf16 few-row copy fits, and on CUDA a profiled share of the GPU (docs/memory.md)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from batchrun.kernels.cpu.quant import packed_nbytes
from batchrun.kernels.layouts.kv_rows import row_width
from batchrun.model.errors import InsufficientMemoryError
from batchrun.model.quant.linear import QuantSpec, is_quantized_linear_weight

log = logging.getLogger(__name__)

GIB = 2**30

# The KV pool of LLM(...) without a job, when neither num_kv_blocks nor kv_cache_memory is given: 2 GiB, or an
# eighth of the machine's memory if that is less (a job sizes it for its rows instead: kv_cache_tokens; a checkpoint
# that only pools, for the prompts in flight: build.py, engine/pooling.py: prompt_only_kv_tokens).
CPU_DEFAULT_KV_BYTES = 2 * GIB
# A default-sized pool shrinks to what is free beside the weights, down to one sequence of this many tokens (or
# of max_model_len, or the job's whole need, if less); below that the model is refused.
MIN_KV_TOKENS = 2048
# Besides the weights and the pools: Python with torch and the tokenizer, a step's activations and logits, one
# linear's packing at a time, oneDNN's scratch.
WORKING_BYTES = GIB


# glibc's mallopt parameters: blocks up to the threshold come from the heap, whose freed top is kept up to the trim
# threshold. The threshold's ceiling is 32 MiB on 64-bit glibc (mallopt refuses more).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEP_HEAP_BYTES = 32 * 2**20
KEEP_FREED_BYTES = GIB


def keep_freed_host_memory() -> bool:
    """A step's activations reuse the heap's pages, not fresh mappings that fault on first touch (after the weights
    load; BATCHRUN_KEEP_FREED=0: glibc's defaults). False where the C library is not glibc."""
    if os.environ.get("BATCHRUN_KEEP_FREED", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, STEP_HEAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f} GiB"


# ---------------------------------------------------------------- what the machine has


@dataclass(frozen=True)
class Available:
    """Bytes this process may still take (`free`), the machine's (or cgroup's) total, and where they come from."""

    free: int
    total: int
    detail: str


def _meminfo(proc: Path) -> dict[str, int]:
    out = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_limit(proc: Path, root: Path) -> tuple[int, int] | None:
    """(limit, usage less inactive file cache) of this process's tightest memory cgroup (v2 or v1), or None."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, group = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2
            base, limit_file, usage_file, cache_key = root, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base, limit_file, usage_file, cache_key = root / "memory", "memory.limit_in_bytes", \
                "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        folder = base / group.lstrip("/")
        if not folder.is_dir():
            folder = base
        while True:
            limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
            if limit is not None and usage is not None and limit < 2**60:
                usage -= min(usage, _stat_value(folder / "memory.stat", cache_key))
                if best is None or limit - usage < best[0] - best[1]:
                    best = (limit, usage)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return best


def available_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> Available:
    """What the OS says this process can still take: MemAvailable, or what a cgroup memory limit leaves if less."""
    info = _meminfo(proc)
    total = info.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 16 * GIB
    free = info.get("MemAvailable", total)
    detail = f"{gib(free)} available of {gib(total)}"
    cgroup = _cgroup_limit(proc, cgroup_root)
    if cgroup is not None:
        limit, usage = cgroup
        total = min(total, limit)
        if limit - usage < free:
            free = max(0, limit - usage)
            detail = f"{gib(free)} left under the cgroup memory limit of {gib(limit)}"
    return Available(free, total, detail)


def cpu_default_bytes(total: int | None = None) -> int:
    if total is None:
        total = available_memory().total
    return min(CPU_DEFAULT_KV_BYTES, total // 8)


# ---------------------------------------------------------------- what a model takes


def checkpoint_weight_bytes(path: Path, element_size: int, quantization: QuantSpec | None = None,
                            gguf_as_stored: bool = False) -> int:
    """The weights as the engine will hold them, from the file headers: the model's dtype, packed linears at their
    packed size. Never less than the load: a fused q|k|v counts part by part, each padded."""
    from batchrun.model.weights.loader import is_gguf, weight_files

    if is_gguf(path):
        from gguf import GGUFReader

        from batchrun.model.weights.gguf_blocks import STORED_LAYOUT

        total = 0
        for t in GGUFReader(path).tensors:
            stored = STORED_LAYOUT.get(t.tensor_type.name) if gguf_as_stored else None
            # a layer's linear (blk.N.*), not its router (ffn_gate_inp): gguf.iter_quantized's choice, by name
            if stored and len(t.shape) == 2 and t.name.startswith("blk.") and "gate_inp" not in t.name:
                bits, group = stored
                total += packed_nbytes(bits, int(t.shape[1]), int(t.shape[0]), group)
            else:
                total += int(t.n_elements) * element_size
        return total
    from safetensors import safe_open

    from batchrun.model.weights import compressed_tensors
    from batchrun.model.weights.loader import stored_scheme

    stored = stored_scheme(path) is not None  # a compressed-tensors checkpoint: its quantized linears as stored
    total = 0
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                stem = compressed_tensors.linear_stem(name, names) if stored else None
                if stem is not None and stem + "weight_scale" in names:
                    scale_shape = tuple(f.get_slice(stem + "weight_scale").get_shape())
                    total += compressed_tensors.held_bytes(name, shape, scale_shape, element_size)
                elif stored and name.rpartition(".")[2] in compressed_tensors.SIDE_TENSORS:
                    continue  # inside the linear's count, or not held (static activation scales)
                elif quantization is not None and is_quantized_linear_weight(name, shape):
                    total += quantization.held_bytes(shape[0], shape[1])
                else:
                    total += math.prod(shape) * element_size
    return total


def kv_bytes_per_token(config, element_size: int, kv_dtype: torch.dtype | None = None) -> int:
    """2 (K and V) x layers x KV heads x row bytes (an int8 pool: one byte a value and a 4-byte scale a head)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_dtype is not None:
        element_size = torch.empty(0, dtype=kv_dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * row_width(head_dim, kv_dtype) * element_size


@dataclass
class MemoryPlan:
    weights: int  # the weights as the engine holds them (packed; a tied bf16 lm_head's packed copy included)
    kv: int  # the KV pool
    swap: int  # the host pool for swap preemption
    available: Available

    @property
    def spare(self) -> int:
        return self.available.free - self.weights - self.kv - self.swap - WORKING_BYTES


def plan_cpu_memory(*, weights: int, bytes_per_token: int, block_size: int, max_model_len: int,
                    kv_bytes: int | None, kv_tokens: int | None, swap: int, available: Available,
                    model: str) -> MemoryPlan:
    """Size the KV pool: the user's kv_bytes whole, or the need (kv_tokens, else the default) shrunk to what is free,
    down to MIN_KV_TOKENS; raise InsufficientMemoryError (one line) where that does not fit."""
    room = available.free - weights - swap - WORKING_BYTES
    if kv_bytes is not None:
        kv, least = kv_bytes, kv_bytes
    else:
        block = bytes_per_token * block_size
        want = kv_tokens * bytes_per_token if kv_tokens is not None else cpu_default_bytes(available.total)
        want = max(1, -(-want // block)) * block  # whole blocks: a job's need rounds up
        least = min(want, bytes_per_token * min(MIN_KV_TOKENS, max_model_len))
        kv = max(least, min(want, room))
    if kv > room:
        need = weights + least + swap + WORKING_BYTES
        pools = f"KV cache {gib(least)}" + (f" + swap space {gib(swap)}" if swap else "")
        raise InsufficientMemoryError(
            f"{model} needs {gib(need)} of memory (weights {gib(weights)} + {pools} + {gib(WORKING_BYTES)} working "
            f"memory) and this machine has {available.detail}"
            + ("; lower engine.kv_cache_memory / num_kv_blocks" if kv_bytes is not None else "")
            + ("; lower engine.swap_space" if swap else ""))
    return MemoryPlan(weights, kv // (bytes_per_token * block_size) * bytes_per_token * block_size, swap, available)


def held_weight_bytes(checkpoint_bytes: int, element_size: int, config, packs_tied_lm_head: bool) -> int:
    """The checkpoint's weights, plus a tied lm_head's packed copy where reorder_linears makes one."""
    tied = bool(getattr(config, "tie_word_embeddings", False)) and packs_tied_lm_head
    return checkpoint_bytes + (config.vocab_size * config.hidden_size * element_size if tied else 0)


# ---------------------------------------------------------------- CUDA


def profile_cuda_kv_bytes(runner_factory, device: torch.device, utilization: float,
                          max_num_batched_tokens: int) -> int:
    """The KV pool's bytes on CUDA: the utilization share, less the weights and a profiled peak forward."""
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
