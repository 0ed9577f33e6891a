"""The linears on packed panels and AMX tiles on a CPU (csrc/linears.c): the ctypes wrappers that
cpu_linear.PackedLinear and OneDNNLinear call, and the row counts up to which the bf16 kernel stands in for
oneDNN's."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "pack_f32_linear": (None, [_P, _I, _I, _P]),
    "pack_bf16_linear": (None, [_P, _I, _I, _P]),
    "linear_f32": (None, [_P, _I, _I, _P, _I, _I, _P, _P]),
    "linear_bf16": (ctypes.c_int, [_P, _I, _P, _I, _I, _P, _P]),
    "f32_linear_panel": (ctypes.c_int, []),
    "amx_linears": (ctypes.c_int, []),
    "dot_linears": (ctypes.c_int, []),
}

# The most rows OneDNNLinear gives linear_bf16 where oneDNN runs a bf16 model (elsewhere every row count goes to
# it: cpu_linear.py, own_kernel); AMX_SMALL_ROWS where the library runs them on AMX, set when this module first reaches the
# library (has_panel_linears, which cpu_linear asks before it packs a weight). Measured on SmolLM2's 120 layer
# linears and its lm_head in a forward's order, 2 threads, weights streamed, on an AVX512-BF16/AMX Xeon
# (`python -m benchmarks.linears`):
# - on the fp32 panels (bf16 widened; CPUs with AVX512-BF16 but no AMX), median of 5, 2026-12-02 03:00: 0.52x
#   oneDNN's reordered bf16 weights' time at 1 row, 0.64x at 8, 0.98x at 16, 0.87x at 24, 1.13x at 32, 2.9x at 64;
# - on AMX tiles (amx_panel), median of 3, 2026-12-02 14:50: 0.65-0.78x at 1-32 rows (11.2-11.5 ms from 1 to 16
#   rows, where the fp32 panels took 10.4-18.4 ms), 0.94-0.95x at 48 and 64, 1.01-1.16x at 96-256.
SMALL_ROWS = 24
AMX_SMALL_ROWS = 64


@cache
def _library() -> ctypes.CDLL | None:
    global SMALL_ROWS
    lib = cpu_kernels.library(SIGNATURES)
    if lib is not None and lib.amx_linears():
        SMALL_ROWS = AMX_SMALL_ROWS
    return lib


def has_panel_linears() -> bool:
    """Whether the panel linears (linear_f32, and linear_bf16 on bf16 panels) run here: the kernels are built, for
    a CPU with AVX-512, or AVX2 and FMA."""
    lib = _library()
    return lib is not None and lib.f32_linear_panel() > 0


def bf16_kernel() -> str:
    """Which kernel linear_bf16 runs here: "amx" (AMX tiles where k is a multiple of 32, vdpbf16ps for other even
    k), "dot" (vdpbf16ps, k even: a CPU with AVX512-BF16 and no AMX), "widened" (bf16 widened to fp32
    multiply-adds), or "" where the panels do not run. BATCHRUN_AMX=0 and BATCHRUN_BF16_DOT=0 turn the first two
    off."""
    if not has_panel_linears():
        return ""
    lib = _library()
    return "amx" if lib.amx_linears() else "dot" if lib.dot_linears() else "widened"


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
