"""The fused element-wise ops of a decoder layer (csrc/elementwise.c)."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import dtype_flag

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "rms_norm": (None, [_P, _P, _P, _P, _I, _I, _F, _B, _B, _B]),
    "rms_norm_heads": (None, [_P, _I, _P, _P, _I, _I, _I, _F, _B]),
    "add_residual": (None, [_P, _P, _P, _I, _I, _B, _B]),  # (the native call's: decoder.c)
    "silu_mul": (None, [_P, _P, _I, _I, _B]),
    "gelu_tanh_mul": (None, [_P, _P, _I, _I, _B]),
    "tanh_cap": (None, [_P, _I, _F]),
    "rope": (None, [_P, _I, _I, _I, _I, _I, _P, _P, _P, _B]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * rmsnorm(x [+ residual]); x + residual is written back into residual (x's dtype, or fp32)."""
    out = torch.empty_like(x)
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    res = residual.data_ptr() if residual is not None else None
    res_fp32 = residual is not None and residual.dtype == torch.float32
    if residual is not None and residual.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"rms_norm: a {residual.dtype} residual for {x.dtype} activations")
    _library().rms_norm(x.data_ptr(), res, weight.data_ptr(), out.data_ptr(), rows, dim, eps,
                        int(residual is not None), int(res_fp32), dtype_flag(x))
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm of each row of x [N, D] or head of x [N, H, D] (rows read in place), contiguous."""
    heads, dim = (x.shape[1], x.shape[2]) if x.dim() == 3 else (1, x.shape[1])
    out = torch.empty(x.shape, dtype=x.dtype)
    _library().rms_norm_heads(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], heads, dim,
                              eps, dtype_flag(x))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up [N, I]."""
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype)
    _library().silu_mul(gate_up.data_ptr(), out.data_ptr(), n, inter, dtype_flag(gate_up))
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> gelu_tanh(gate) * up [N, I] (GeGLU)."""
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype)
    _library().gelu_tanh_mul(gate_up.data_ptr(), out.data_ptr(), n, inter, dtype_flag(gate_up))
    return out


def tanh_cap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """x = cap * tanh(x / cap) in place on a contiguous fp32 tensor (final logit soft-capping); returns x."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("tanh_cap_ takes a contiguous float32 tensor")
    _library().tanh_cap(x.data_ptr(), x.numel(), cap)
    return x


def rope_(x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of x in place by fp32 cos, sin [max_pos, rot <= head_dim]."""
    _library().rope(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.shape[1], positions.data_ptr(),
                    cos.data_ptr(), sin.data_ptr(), dtype_flag(x))
