"""A step's forward to the final norm in one native call (csrc/decoder.c): the structures it reads and its wrapper."""

from __future__ import annotations

import ctypes
from functools import cache

from batchrun.kernels import cpu as cpu_kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

LINEAR_F32, LINEAR_BF16, LINEAR_QUANT = 0, 1, 2
LAYER_PRE_NORM, LAYER_SANDWICH, LAYER_POST_NORM = 0, 1, 2
ROPES = {"global": 0, "local": 1}
ACTIVATIONS = {"silu_mul": 0, "gelu_tanh_mul": 1}
KV_MODEL_DTYPE, KV_INT8, KV_FP8_E4M3, KV_FP8_E5M2 = 0, 1, 2, 3


class NativeLinear(ctypes.Structure):
    _fields_ = [("kind", _I), ("n", _I), ("k", _I), ("packed", _P), ("bias", _P), ("scale", _P), ("offset", _P),
                ("weight_group", _I), ("group", _I), ("bits", _I), ("plain", _I)]


class DecoderLayer(ctypes.Structure):
    _fields_ = [("qkv", NativeLinear), ("o", NativeLinear), ("gate_up", NativeLinear), ("down", NativeLinear),
                ("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("pre_ff_norm", _P),
                ("post_ff_norm", _P), ("kind", _I), ("window", _I), ("rope", _I), ("scale", _F), ("softcap", _F),
                ("residual_scale", _F), ("router", NativeLinear), ("experts", _P), ("shared_gate", NativeLinear),
                ("inter", _I)]


class DecoderShape(ctypes.Structure):
    _fields_ = [("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I), ("rot", _I),
                ("block_size", _I), ("activation", _I), ("kv_format", _I), ("amx_lanes", _I), ("bf", _I),
                ("res_fp32", _I), ("qk_proj", _I), ("experts", _I), ("top_k", _I), ("normalize", _I),
                ("eps", _F), ("embed_scale", _F)]


class DecoderStep(ctypes.Structure):
    _fields_ = [("ids", _P), ("embed", _P), ("vocab", _I), ("final_norm", _P), ("residual", _P), ("x", _P), ("h", _P),
                ("qkv", _P), ("attn", _P), ("gate_up", _P), ("act", _P), ("q_normed", _P), ("k_normed", _P),
                ("v_copy", _P), ("rows", _I),
                ("positions", _P), ("slots", _P), ("cos_t", _P), ("sin_t", _P), ("cos_local", _P), ("sin_local", _P),
                ("block_tables", _P), ("row_seq", _P),
                ("row_len", _P), ("bt_stride", _I), ("kv", _P), ("layer_bytes", _I), ("half_bytes", _I),
                ("lm_packed", _P), ("lm_weight", _P), ("lm_n", _I), ("top", _I), ("tokens", _P),
                ("router_logits", _P), ("expert_in", _P), ("expert_out", _P), ("route_weights", _P),
                ("route_experts", _P), ("pair_row", _P), ("row_pair", _P), ("expert_start", _P)]


SIGNATURES: dict[str, cpu_kernels.Signature] = {
    "decoder_forward": (ctypes.c_int, [ctypes.POINTER(DecoderShape), ctypes.POINTER(DecoderLayer), _I,
                                      ctypes.POINTER(DecoderStep)]),
}


@cache
def _library() -> ctypes.CDLL | None:
    return cpu_kernels.library(SIGNATURES)


def available() -> bool:
    return _library() is not None


def decoder_forward(shape: DecoderShape, layers: ctypes.Array, step: DecoderStep) -> bool:
    """The step's forward to the final norm, with an lm_head its greedy tokens, where `step` points; False on a NaN."""
    status = _library().decoder_forward(ctypes.byref(shape), layers, len(layers), ctypes.byref(step))
    if status == 2:
        raise IndexError("decoder_forward: a token id outside the embedding table")
    if status == 1:
        raise MemoryError("decoder_forward: a kernel found no scratch memory")
    return status == 0
