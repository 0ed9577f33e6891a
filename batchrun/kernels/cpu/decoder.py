"""A step's pre-norm decoder layers in one native call (csrc/decoder.c): the structures it reads and its wrapper."""

from __future__ import annotations

import ctypes
from functools import cache

from batchrun.kernels import cpu as cpu_kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

LINEAR_F32, LINEAR_BF16, LINEAR_QUANT = 0, 1, 2
ACTIVATIONS = {"silu_mul": 0, "gelu_tanh_mul": 1}
KV_MODEL_DTYPE, KV_INT8 = 0, 1


class NativeLinear(ctypes.Structure):
    _fields_ = [("kind", _I), ("n", _I), ("k", _I), ("packed", _P), ("bias", _P), ("scale", _P), ("offset", _P),
                ("weight_group", _I), ("group", _I), ("bits", _I), ("plain", _I)]


class DecoderLayer(ctypes.Structure):
    _fields_ = [("qkv", NativeLinear), ("o", NativeLinear), ("gate_up", NativeLinear), ("down", NativeLinear),
                ("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("window", _I), ("scale", _F),
                ("softcap", _F)]


class DecoderShape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I), ("rot", _I),
                ("block_size", _I), ("activation", _I), ("kv_format", _I), ("amx_lanes", _I), ("bf", _I),
                ("res_fp32", _I), ("eps", _F)]


class DecoderStep(ctypes.Structure):
    _fields_ = [("x_in", _P), ("residual", _P), ("x", _P), ("h", _P), ("qkv", _P), ("attn", _P), ("gate_up", _P),
                ("act", _P), ("q_normed", _P), ("k_normed", _P), ("k_copy", _P), ("v_copy", _P), ("rows", _I),
                ("positions", _P), ("slots", _P), ("cos_t", _P), ("sin_t", _P), ("block_tables", _P), ("row_seq", _P),
                ("row_len", _P), ("bt_stride", _I), ("kv", _P), ("layer_bytes", _I), ("half_bytes", _I)]


SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "decoder_layers": (ctypes.c_int, [ctypes.POINTER(DecoderShape), ctypes.POINTER(DecoderLayer), _I,
                                      ctypes.POINTER(DecoderStep)]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def available() -> bool:
    return _library() is not None


def decoder_layers(shape: DecoderShape, layers: ctypes.Array, step: DecoderStep) -> None:
    """Run every layer of `layers` on the step; the outputs land where `step` points."""
    if _library().decoder_layers(ctypes.byref(shape), layers, len(layers), ctypes.byref(step)):
        raise MemoryError("decoder_layers: a kernel found no scratch memory")
