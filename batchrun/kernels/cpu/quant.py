"""Quantized linears (csrc/quant_linears.c): weights packed once, activations quantized on the fly."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache

import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.layouts.quant_weight import QuantizedWeight

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "pack_int8_linear": (None, [_P, _P, _I, _I, _I, _P, _P]),
    "pack_int4_linear": (None, [_P, _P, _P, _I, _I, _I, _P, _P, _P]),
    "quant_linear": (ctypes.c_int, [_P, _I, _I, ctypes.c_int, _P, _P, _P, _I, _I, _I, ctypes.c_int, _P, _P,
                                    ctypes.c_int, ctypes.c_int]),
    "quant_linear_panel": (ctypes.c_int, []),
    "quant_isa": (ctypes.c_int, []),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def available() -> bool:
    return _library() is not None


def kernel() -> str:
    """The kernel that runs: "vnni", "avx2", "plain" (no AVX2, or BATCHRUN_QUANT_VNNI=0), "" (no library)."""
    if _library() is None:
        return ""
    isa = _library().quant_isa()
    if isa == 0 or os.environ.get("BATCHRUN_QUANT_VNNI", "1") == "0":
        return "plain"
    return "vnni" if isa == 2 else "avx2"


# The most inputs of a row that share one activation scale (accuracy by group size: docs/quantization.md).
ACTIVATION_GROUP = 32


def kernel_group(weight: QuantizedWeight) -> int:
    """The activation group: the weights' group, or its largest divisor in whole k-steps up to ACTIVATION_GROUP."""
    step = 4 if weight.bits == 8 else 8
    if weight.group_size <= ACTIVATION_GROUP:
        return weight.group_size
    return next((g for g in range(ACTIVATION_GROUP - ACTIVATION_GROUP % step, step - 1, -step)
                 if weight.group_size % g == 0), weight.group_size)


def supports(weight: QuantizedWeight) -> bool:
    """Whether the inputs and groups are whole k-steps (4 inputs for int8, 8 for int4)."""
    step = 4 if weight.bits == 8 else 8
    return weight.shape[1] % step == 0 and weight.group_size % step == 0


# Outputs per panel of the packed layout: csrc/quant_linears.c's QP (pack checks that they agree).
PANEL = 32


def packed_nbytes(bits: int, out_features: int, in_features: int, group_size: int) -> int:
    """Bytes pack() holds for a weight of this shape (the memory plan counts quantized linears with it)."""
    rows = -(-out_features // PANEL) * PANEL
    return rows * in_features * bits // 8 + rows * (in_features // group_size) * 4 * (1 if bits == 8 else 2)


@dataclass
class PackedQuantWeight:
    """A weight in the kernel's panels; group_size is the activation group (kernel_group)."""

    bits: int
    out_features: int
    in_features: int
    weight_group: int
    group_size: int
    packed: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)


def pack(weight: QuantizedWeight) -> PackedQuantWeight:
    if not supports(weight):
        raise ValueError(f"quantized linears need inputs and groups in multiples of {4 if weight.bits == 8 else 8}, "
                         f"not {weight.shape[1]} inputs in groups of {weight.group_size}")
    lib = _library()
    n, k = weight.shape
    panel = lib.quant_linear_panel()
    assert panel == PANEL, f"the library's panels hold {panel} outputs, PANEL says {PANEL}"
    panels, groups = (n + panel - 1) // panel, k // weight.group_size
    q = weight.qweight.contiguous()
    scale = weight.scale.to(torch.float32).contiguous()
    packed = torch.empty(panels * panel * k // (1 if weight.bits == 8 else 2), dtype=torch.uint8)
    pscale = torch.empty(panels * groups * panel, dtype=torch.float32)
    poffset = None
    if weight.bits == 8:
        lib.pack_int8_linear(q.data_ptr(), scale.data_ptr(), n, k, weight.group_size, packed.data_ptr(),
                             pscale.data_ptr())
    else:
        offset = weight.offset.to(torch.float32).contiguous()
        poffset = torch.empty(panels * groups * panel, dtype=torch.float32)
        lib.pack_int4_linear(q.data_ptr(), scale.data_ptr(), offset.data_ptr(), n, k, weight.group_size,
                             packed.data_ptr(), pscale.data_ptr(), poffset.data_ptr())
    return PackedQuantWeight(weight.bits, n, k, weight.group_size, kernel_group(weight), packed, pscale, poffset)


def linear(x: torch.Tensor, weight: PackedQuantWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, plain: bool | None = None) -> torch.Tensor:
    """x [rows, K] fp32 or bf16 -> [rows, N] in out_dtype (x's by default); plain: the C loop (None: kernel())."""
    rows, k = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    out_dtype = out_dtype or x.dtype
    if plain is None:
        plain = kernel() == "plain"
    out = torch.empty(rows, weight.out_features, dtype=out_dtype)
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    if _library().quant_linear(x.data_ptr(), rows, k, int(x.dtype == torch.bfloat16), weight.packed.data_ptr(),
                               weight.scale.data_ptr(), None if weight.offset is None else weight.offset.data_ptr(),
                               weight.out_features, weight.weight_group, weight.group_size, weight.bits, None if bias is None else bias.data_ptr(),
                               out.data_ptr(), int(out_dtype == torch.bfloat16), int(plain)):
        raise MemoryError("quant_linear: no memory for the quantized rows")
    return out
