"""CPU kernels (csrc/cpu_kernels.c): built on first use, called through ctypes.

On a CPU, decode attention and the element-wise ops of a layer are bound by memory traffic and per-op
dispatch: gathering every decode sequence's blocks before SDPA moves each K/V byte three times, and torch
runs an RMSNorm as five passes. The C kernels make one pass each and read K/V in place through the block
tables. They are plain C99 compiled with the system C compiler (no torch headers, so they build in about a
second) into the batchrun cache, keyed by source, compiler and CPU. Their OpenMP loops run on torch's own
OpenMP runtime (torch ships libgomp.so.1 and has it loaded when the library loads), so the two never fight
over the cores. Without a compiler, or with BATCHRUN_CPU_KERNELS=0, every op takes its torch path.

Each wrapper takes fp32 or bf16 CPU tensors (all of one dtype, but for the fp32 rotary tables) whose
innermost dimension is contiguous; bf16 is computed with fp32 arithmetic and accumulation. Whether a model
uses them is decided once, at load (ops.select_ops, backends.select_backend), not per call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# -ffp-contract=fast: fused multiply-adds, as MKL's matmuls use (ISO C mode would turn them off)
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c99"]

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # the last int of each is the dtype flag: 0 fp32, 1 bf16 (store_kv: the element size)
    "paged_attention": [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _B, _I],
    "store_kv": [_P, _P, _I, _P, _I, _I, _P, _P, _I],
    "rms_norm": [_P, _P, _P, _P, _I, _I, _F, _B, _B, _B],
    "silu_mul": [_P, _P, _I, _I, _B],
    "rope": [_P, _I, _I, _I, _I, _P, _P, _P, _B],
    "logits_top": [_P, _P, _I, _I, _I, _P],
    "apply_token_bitmask": [_P, _I, _P, _I, _P, _I, _I],
    "pack_bf16_linear": [_P, _I, _I, _P],
    "linear_bf16": [_P, _I, _P, _I, _I, _P, _P],
    "f32_linear_panel": [],
    "amx_linears": [],
    "pack_f32_linear": [_P, _I, _I, _P],
    "linear_f32": [_P, _I, _I, _P, _I, _I, _P, _P],
}
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take


def _cpu_signature() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@cache
def _library() -> ctypes.CDLL | None:
    global SMALL_ROWS
    if os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0":
        return None
    lib = build(_SRC.read_bytes(), _SIGNATURES)
    if lib is not None and lib.amx_linears():
        SMALL_ROWS = AMX_SMALL_ROWS
    return lib


def build(src: bytes, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """Compile C source `src` (cached by its hash, the compiler and the CPU) and declare `signatures`;
    None without a compiler or if the build fails. The benchmarks also build an older source with it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: CPU ops use their torch paths")
        return None
    from batchrun.model.paths import cache_dir

    key = hashlib.sha256(src + " ".join([cc, *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    lib = cache_dir() / "kernels" / f"cpu_kernels-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        c_file = Path(tmp).with_suffix(".c")
        try:
            c_file.write_bytes(src)
            subprocess.run([cc, *_FLAGS, "-o", tmp, str(c_file), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            log.warning("building the CPU kernels failed (%s %s); using the torch paths", e,
                        err.decode(errors="replace")[:200])
            Path(tmp).unlink(missing_ok=True)
            return None
        finally:
            c_file.unlink(missing_ok=True)
    so = ctypes.CDLL(str(lib))
    for name, args in signatures.items():
        fn = getattr(so, name)
        fn.argtypes, fn.restype = args, None
    for name in ("paged_attention", "f32_linear_panel", "linear_bf16", "amx_linears"):  # these answer an int
        if name in signatures:
            getattr(so, name).restype = ctypes.c_int
    return so


def available() -> bool:
    return _library() is not None


def _bf(x: torch.Tensor) -> int:
    """The kernels' dtype flag."""
    return int(x.dtype == torch.bfloat16)


# The fewest lanes (a tile's rows x query heads per kv head) for which bf16 attention goes to AMX outside the
# batch-invariant mode: prefill chunks, not decode rows (cpu_kernels.c, amx_attend_head, has the measurements).
AMX_PREFILL_LANES = 16


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                    row_len: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                    amx_lanes: int = 1) -> torch.Tensor:
    """Paged attention for any mix of decode and prefill / extend query rows, in one call.

    q [N, Hq, D] (rows may be strided, e.g. a view of the fused qkv projection); kv_cache [2, NB, BS, Hkv, D]
    (one layer, q's dtype) already holding the step's K/V; block_tables int32 [S, >= blocks of the longest
    row]; row_seq int32 [N]: each row's sequence (its block-table row); row_len int32 [N]: each row attends to
    keys [0, row_len) of its sequence (a decode row: the context length; a prefill row at position p: p + 1).
    Rows of one sequence should be consecutive (they share K/V loads). Returns out [N, Hq, D].
    A row's result depends on that row's query, keys and values only, bit for bit (batch invariance), unless
    amx_lanes > 1: bf16 tiles of at least that many lanes (rows x query heads per kv head: prefill chunks) then go
    to AMX where the CPU has it, the others (decode rows) to the vector kernel; 0 keeps all on the vector kernel,
    1 (the default) puts all on AMX where it runs."""
    n, hq, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    bt = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
    if out is None:
        out = torch.empty(n, hq, d, dtype=q.dtype)
    k_ptr = kv_cache.data_ptr()  # kv_cache[0] and [1] without two indexing ops per layer
    v_ptr = k_ptr + kv_cache.stride(0) * kv_cache.element_size()
    if _library().paged_attention(q.data_ptr(), q.stride(0), k_ptr, v_ptr, bt.data_ptr(), bt.stride(0),
                                  row_seq.data_ptr(), row_len.data_ptr(), out.data_ptr(), n, hq, hkv, d, bs, scale,
                                  _bf(q), amx_lanes):
        raise MemoryError("paged attention: no memory for the score buffers")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [N, Hkv, D] with the same row stride (views of one qkv row), slot_mapping int64 [N], -1 skipped."""
    n, hkv, d = k.shape
    if k.stride() != v.stride() or k.stride(1) != d:
        k, v = k.contiguous(), v.contiguous()
    k_ptr = kv_cache.data_ptr()
    _library().store_kv(k.data_ptr(), v.data_ptr(), k.stride(0), slot_mapping.data_ptr(), n, hkv * d,
                        k_ptr, k_ptr + kv_cache.stride(0) * kv_cache.element_size(), k.element_size())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rmsnorm(x [+ residual]); with a residual, x + residual is also written into residual, which is
    x's dtype or fp32 (a bf16 model's fp32 residual stream: h is then kept unrounded)."""
    out = torch.empty_like(x)
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    res = residual.data_ptr() if residual is not None else None
    res_fp32 = residual is not None and residual.dtype == torch.float32
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"rms_norm: a {residual.dtype} residual for {x.dtype} activations")
    _library().rms_norm(x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), rows, dim, eps,
                        int(residual is not None), int(res_fp32), _bf(x))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype)
    _library().silu_mul(gate_up.data_ptr(), out.data_ptr(), n, inter, _bf(gate_up))
    return out


def rope_(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of x [N, >= heads * head_dim] in place; positions int64 [N];
    cos/sin fp32 tables [max_pos, head_dim]."""
    _library().rope(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, positions.data_ptr(),
                    cos.data_ptr(), sin.data_ptr(), _bf(x))


def logits_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits [N, V] -> (the same in fp32, int64 [N, k] indices of each row's k largest, in no order);
    k <= 64."""
    if not logits.is_contiguous():
        logits = logits.contiguous()
    n, vocab = logits.shape
    out = torch.empty(n, vocab, dtype=torch.float32)
    top = torch.empty(n, k, dtype=torch.int64)
    _library().logits_top(logits.data_ptr(), out.data_ptr(), n, vocab, k, top.data_ptr())
    return out, top


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int) -> None:
    """logits fp32 [N, >= vocab] (rows contiguous), in place: -inf where the int32 bitmask [>= N, words]
    (xgrammar's layout: bit t % 32 of word t // 32) has token t off, for the listed rows only."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1 or logits.dtype != torch.float32:
        raise ValueError("apply_token_bitmask takes fp32 logits and an int32 bitmask with contiguous rows")
    index = torch.tensor(rows, dtype=torch.int64)
    _library().apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                                   index.data_ptr(), len(rows), min(vocab, logits.shape[-1], 32 * bitmask.shape[-1]))


# The most rows OneDNNLinear gives linear_bf16 where oneDNN has bf16 kernels (elsewhere every row count goes to
# it: cpu_linear.py); set when the library is built. Measured on SmolLM2's 120 layer linears and its lm_head in a
# forward's order, 2 threads, weights streamed, on an AVX512-BF16/AMX Xeon (`python -m benchmarks.linears`):
# - on the fp32 panels (bf16 widened; CPUs with AVX512-BF16 but no AMX), median of 5, 2026-12-02 03:00: 0.52x
#   oneDNN's reordered bf16 weights' time at 1 row, 0.64x at 8, 0.98x at 16, 0.87x at 24, 1.13x at 32, 2.9x at 64;
# - on AMX tiles (amx_panel), median of 3, 2026-12-02 14:50: 0.65-0.78x at 1-32 rows (11.2-11.5 ms from 1 to 16
#   rows, where the fp32 panels took 10.4-18.4 ms), 0.94-0.95x at 48 and 64, 1.01-1.16x at 96-256.
SMALL_ROWS = 24
AMX_SMALL_ROWS = 64


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bf16 times the packed weight: [rows, out_features] bf16, with fp32 sums (over k in order, so
    a row's result does not depend on the other rows)."""
    rows, k = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    if _library().linear_bf16(x.data_ptr(), rows, packed.data_ptr(), out_features, k,
                              None if bias is None else bias.data_ptr(), out.data_ptr()):
        raise MemoryError("linear_bf16: no memory for the widened rows")
    return out


def has_panel_linears() -> bool:
    """Whether the panel linears (linear_f32, and linear_bf16 on bf16 panels) run here: the kernels are built, for
    a CPU with AVX-512, or AVX2 and FMA."""
    return available() and _library().f32_linear_panel() > 0


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 or bf16 weight [N, K] packed for linear_f32 or linear_bf16: panels of the kernel's width of
    outputs, each K x width, in the weight's dtype."""
    n, k = weight.shape
    w = weight.detach().contiguous()
    panel = _library().f32_linear_panel()
    packed = torch.empty((n + panel - 1) // panel * panel * k, dtype=w.dtype)
    pack = _library().pack_f32_linear if w.dtype == torch.float32 else _library().pack_bf16_linear
    pack(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def linear_f32(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] fp32 (rows contiguous) times the packed weight: [rows, out_features] fp32. A row's result
    does not depend on the other rows, bit for bit."""
    rows, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=torch.float32)
    _library().linear_f32(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, k,
                          None if bias is None else bias.data_ptr(), out.data_ptr())
    return out
