"""Linears on weights packed into panels, and on AMX tiles (csrc/linears.c)."""

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

# The most rows OneDNNLinear gives linear_bf16 where oneDNN runs a bf16 model; AMX_SMALL_ROWS where the library
# runs them on AMX (set when _library first loads). The measurements: docs/cpu-kernels.md.
SMALL_ROWS = 24
AMX_SMALL_ROWS = 128
AMX_K = 32  # the k of an AMX tile product: linears whose k is a multiple of it run on AMX tiles


@cache
def _library() -> ctypes.CDLL | None:
    global SMALL_ROWS
    lib = cpu_kernels.library(SIGNATURES)
    if lib is not None and lib.amx_linears():
        SMALL_ROWS = AMX_SMALL_ROWS
    return lib


def has_panel_linears() -> bool:
    """Whether linear_f32 and linear_bf16 run here (the library built for AVX-512, or AVX2 and FMA)."""
    lib = _library()
    return lib is not None and lib.f32_linear_panel() > 0


@cache
def bf16_kernel() -> str:
    """linear_bf16's kernel here: "amx" (k a multiple of 32; vdpbf16ps for other even k), "dot" (vdpbf16ps, k
    even), "widened" (fp32 multiply-adds), or "". BATCHRUN_AMX=0, BATCHRUN_BF16_DOT=0 turn the first two off (read
    once by the library, so the answer holds for the process: the greedy path asks it every step)."""
    if not has_panel_linears():
        return ""
    lib = _library()
    return "amx" if lib.amx_linears() else "dot" if lib.dot_linears() else "widened"


def panel_view(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Panels packed by pack_linear (fp32, or bf16 on the widening kernel) as a view [panels, panel width, k]: row
    j of panel p is the weight's row p * width + j (zero past its n), no copy."""
    return packed.view(-1, k, _library().f32_linear_panel()).transpose(1, 2)


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 or bf16 weight [N, K] packed for linear_f32 or linear_bf16, in its dtype."""
    n, k = weight.shape
    w = weight.detach().contiguous()
    panel = _library().f32_linear_panel()
    packed = torch.empty((n + panel - 1) // panel * panel * k, dtype=w.dtype)
    pack = _library().pack_f32_linear if w.dtype == torch.float32 else _library().pack_bf16_linear
    pack(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def linear_f32(x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] fp32 -> [rows, out_features] fp32; a row's bits do not depend on the other rows."""
    rows, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=torch.float32)
    _library().linear_f32(x.data_ptr(), x.stride(0), rows, packed.data_ptr(), out_features, k,
                          None if bias is None else bias.data_ptr(), out.data_ptr())
    return out


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K] bf16 -> [rows, out_features] bf16, fp32 sums over k in order (a row's bits are its own)."""
    rows, k = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    if _library().linear_bf16(x.data_ptr(), rows, packed.data_ptr(), out_features, k,
                              None if bias is None else bias.data_ptr(), out.data_ptr()):
        raise MemoryError("linear_bf16: no memory for the widened rows")
    return out
