"""GGUF's quantized blocks read into the plain QuantizedWeight as stored: the same integers and scales, decoded with
numpy views over the block bytes. Q4_0 / Q4_1 hold input j and j + 16 in one byte's nibbles, Q4_K sub-blocks 2c
and 2c + 1 in its c-th 32 bytes; the plain layout pairs inputs 2j and 2j + 1, so 4-bit bytes are repacked."""

from __future__ import annotations

import numpy as np
import torch

from batchrun.kernels.layouts.quant_weight import QuantizedWeight

STORED_TYPES = ("Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K")
# The QuantizedWeight each stored type becomes: (bits, inputs per scale); the memory plan counts with it.
STORED_LAYOUT = {"Q8_0": (8, 32), "Q6_K": (8, 16), "Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32)}
_BLOCK = {"Q8_0": (32, 34), "Q6_K": (256, 210), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


def quantized_weight(kind: str, data: np.ndarray, in_features: int) -> QuantizedWeight:
    """The QuantizedWeight of a GGUF tensor of type `kind` from its bytes, uint8 [out_features, bytes per row]."""
    block_size, block_bytes = _BLOCK[kind]
    rows = data.shape[0]
    if in_features % block_size or data.shape[1] != in_features // block_size * block_bytes:
        raise ValueError(f"a {kind} row of {in_features} inputs is not {data.shape[1]} bytes")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, in_features // block_size, block_bytes)
    return _DECODERS[kind](blocks)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _rows(values: np.ndarray, rows: int) -> torch.Tensor:
    """float32 [rows, groups] from per-block values [rows, blocks, ...] (groups in order within a block)."""
    return torch.from_numpy(np.ascontiguousarray(values.reshape(rows, -1), dtype=np.float32))


def _int8(q: np.ndarray, scale: np.ndarray, group_size: int) -> QuantizedWeight:
    """q: the integers [rows, blocks, ...] in input order, as int8 or as their bytes."""
    rows = q.shape[0]
    qweight = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1).view(np.int8)))
    return QuantizedWeight(bits=8, qweight=qweight, scale=_rows(scale, rows), offset=None, group_size=group_size)


def _int4(packed: torch.Tensor, scale: np.ndarray, offset: np.ndarray) -> QuantizedWeight:
    """packed: the plain packed bytes [rows, blocks, ...] in input order; groups of 32."""
    rows = packed.shape[0]
    return QuantizedWeight(bits=4, qweight=packed.reshape(rows, -1), scale=_rows(scale, rows),
                           offset=_rows(offset, rows), group_size=32)


def _repack_halves(packed: np.ndarray) -> torch.Tensor:
    """Bytes [..., n] holding value i in the low nibble of byte i and n + i in its high one -> the plain packing of
    those 2n values (2j low, 2j + 1 high), byte for byte."""
    pairs = torch.from_numpy(np.ascontiguousarray(packed)).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.cat(((even & 0x0F) | ((odd & 0x0F) << 4), (even >> 4) | (odd & 0xF0)), dim=-1)


def _q8_0(blocks: np.ndarray) -> QuantizedWeight:
    return _int8(blocks[..., 2:], _f16(blocks, 0), 32)


def _q4_0(blocks: np.ndarray) -> QuantizedWeight:
    d = _f16(blocks, 0)
    return _int4(_repack_halves(blocks[..., 2:]), d, -8.0 * d)


def _q4_1(blocks: np.ndarray) -> QuantizedWeight:
    return _int4(_repack_halves(blocks[..., 4:]), _f16(blocks, 0), _f16(blocks, 2))


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of eight 6-bit scales and eight 6-bit mins -> two uint8 [..., 8]. Bytes 0-3 hold the
    low 6 bits of scales 0-3, bytes 4-7 those of mins 0-3; bytes 8-11 the low 4 bits of scales 4-7 (low
    nibble) and mins 4-7 (high nibble), whose top 2 bits sit in the top 2 bits of bytes 0-3 and 4-7."""
    first, second, third = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate((first & 0x3F, (third & 0x0F) | ((first >> 6) << 4)), axis=-1)
    mins = np.concatenate((second & 0x3F, (third >> 4) | ((second >> 6) << 4)), axis=-1)
    return scales, mins


def _q4_k(blocks: np.ndarray) -> QuantizedWeight:
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    scales, mins = _k_scales_mins(blocks[..., 4:16])
    rows, count = blocks.shape[:2]
    chunks = blocks[..., 16:].reshape(rows, count, 4, 32)  # chunk c: sub-blocks 2c (low) and 2c + 1 (high)
    return _int4(_repack_halves(chunks), d * scales.astype(np.float32), -(dmin * mins.astype(np.float32)))


def _q6_k(blocks: np.ndarray) -> QuantizedWeight:
    """Q6_K: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, fp16 d. Each half of 128 values takes
    64 low bytes and 32 high bytes: values l, l+32, l+64, l+96 are the low nibble of byte l, of byte l+32, the
    high nibble of byte l, of byte l+32, with bits 0-1, 2-3, 4-5, 6-7 of high byte l on top."""
    rows, count = blocks.shape[:2]
    low = blocks[..., :128].reshape(rows, count, 2, 2, 32)  # [half, byte l or l+32, l]
    high = blocks[..., 128:192].reshape(rows, count, 2, 1, 32)
    low_bits = np.concatenate((low & 0x0F, low >> 4), axis=3)  # [half, 4 quarters, 32]
    high_bits = (high >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q = (low_bits | (high_bits << 4)).astype(np.int8) - np.int8(32)
    sub_scales = blocks[..., 192:208].view(np.int8).astype(np.float32)
    return _int8(q, _f16(blocks, 208)[..., None] * sub_scales, 16)


_DECODERS = {"Q8_0": _q8_0, "Q6_K": _q6_k, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}
