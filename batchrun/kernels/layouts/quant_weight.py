"""Quantized linear weights: the one plain layout every quantized source is read into and every kernel packs from.
    8 bits:  w[o, i] = q[o, i] * scale[o, g]                   q: int8, -127..127
    4 bits:  w[o, i] = q[o, i] * scale[o, g] + offset[o, g]    q: 0..15, two per byte (even i low nibble)
g = i // group_size: batchrun's own quantization and GGUF's Q8_0, Q6_K, Q4_0, Q4_1, Q4_K exactly (docs/models.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedWeight:
    bits: int  # 8 or 4
    qweight: torch.Tensor  # 8 bits: int8 [out, in]; 4 bits: uint8 [out, in // 2], input 2j low nibble, 2j+1 high
    scale: torch.Tensor  # float32 [out, in // group_size]
    offset: torch.Tensor | None  # 4 bits: float32 [out, in // group_size]; 8 bits: None
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights are 4 or 8 bits, not {self.bits}")
        out_features, in_features = self.shape
        if in_features % self.group_size:
            raise ValueError(f"{in_features} inputs do not split into groups of {self.group_size}")
        groups = (out_features, in_features // self.group_size)
        if tuple(self.scale.shape) != groups or (self.offset is not None and tuple(self.offset.shape) != groups):
            raise ValueError(f"scales of shape {tuple(self.scale.shape)} for {groups} groups")
        if (self.bits == 4) != (self.offset is not None):
            raise ValueError("4-bit weights have an offset per group, 8-bit ones none")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        rows, columns = self.qweight.shape
        return rows, columns * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        extra = self.offset.nbytes if self.offset is not None else 0
        return self.qweight.nbytes + self.scale.nbytes + extra

    def to(self, device: torch.device) -> QuantizedWeight:
        offset = self.offset.to(device) if self.offset is not None else None
        return QuantizedWeight(self.bits, self.qweight.to(device), self.scale.to(device), offset, self.group_size)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in // 2] -> uint8 [out, in] of 0..15."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    pairs = values.to(torch.uint8).reshape(values.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    q = unpack_int4(weight.qweight) if weight.bits == 4 else weight.qweight
    scale = weight.scale.repeat_interleave(weight.group_size, dim=1)
    w = q.to(torch.float32) * scale
    if weight.offset is not None:
        w += weight.offset.repeat_interleave(weight.group_size, dim=1)
    return w


def linear_ref(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ w.T in float32: what a quantized kernel is held to."""
    return x.to(torch.float32) @ dequantize(weight).T


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> QuantizedWeight:
    """Symmetric, a scale per group of `group_size` inputs (None: the row), its largest magnitude mapping to 127."""
    w = weight.to(torch.float32)
    out_features, in_features = w.shape
    group_size = group_size or in_features
    if in_features % group_size:
        raise ValueError(f"{in_features} inputs do not split into groups of {group_size}")
    groups = w.reshape(out_features, in_features // group_size, group_size)
    scale = groups.abs().amax(dim=2).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(groups / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(bits=8, qweight=q.reshape(out_features, in_features), scale=scale, offset=None,
                           group_size=group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Symmetric per group: q - 8 in -8..7 times the scale, its largest magnitude mapping to 7."""
    w = weight.to(torch.float32)
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"{in_features} inputs do not split into groups of {group_size}")
    groups = w.reshape(out_features, in_features // group_size, group_size)
    scale = groups.abs().amax(dim=2).clamp_min(torch.finfo(torch.float32).tiny) / 7.0
    q = torch.round(groups / scale[..., None]).clamp_(-8, 7) + 8
    return QuantizedWeight(bits=4, qweight=pack_int4(q.reshape(out_features, in_features)), scale=scale,
                           offset=-8.0 * scale, group_size=group_size)
