"""compressed-tensors checkpoints (llm-compressor, vLLM) run as stored: `int-quantized` (int8 `X.weight` and
`X.weight_scale` per channel or group) and `pack-quantized` (int32 words of eight q + 8 nibbles, input 8j + i in
bits 4i..4i+3 of word j: on a little-endian machine the plain int4 layout). Anything else is refused in one line."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.model.errors import ModelLoadError

if TYPE_CHECKING:  # torch loads only when the weights are read (checking a job stays light)
    import torch

    from batchrun.kernels.layouts.quant_weight import QuantizedWeight

FORMAT_BITS = {"int-quantized": 8, "pack-quantized": 4}
# the tensors of a quantized linear beside its integers (read with them), and static activation scales (batchrun
# quantizes activations per row and group at run time, so a calibrated input scale has no use here)
SIDE_TENSORS = ("weight_scale", "weight_shape", "input_scale", "input_zero_point")


@dataclass(frozen=True)
class StoredScheme:
    """A checkpoint's quantized linears, as its config says: bits 8 or 4, inputs per scale (None: per channel)."""

    bits: int
    group_size: int | None

    def describe(self) -> str:
        per = f"groups of {self.group_size}" if self.group_size else "per output channel"
        return f"compressed-tensors int{self.bits} ({per})"


def stored_scheme(config: dict, spec: str = "the checkpoint") -> StoredScheme | None:
    """None for a full-precision config, the StoredScheme batchrun runs, or ModelLoadError (one line)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{spec}: config.json's quantization_config is not a JSON object")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ModelLoadError(f"{spec} is quantized with {method!r}, which batchrun does not read (it runs "
                             "compressed-tensors int8 and int4 checkpoints, or quantizes a full-precision one "
                             "itself: quantization int8 / int4)")
    fmt = qc.get("format")
    if fmt not in FORMAT_BITS:
        raise ModelLoadError(f"{spec}: compressed-tensors format {fmt!r} is not supported (batchrun reads "
                             f"{' and '.join(FORMAT_BITS)})")
    unsupported = [key for key in ("sparsity_config", "kv_cache_scheme", "transform_config") if qc.get(key)]
    if unsupported:
        raise ModelLoadError(f"{spec}: compressed-tensors {', '.join(unsupported)} is not supported")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ModelLoadError(f"{spec}: quantization_status {qc.get('quantization_status')!r}: batchrun reads "
                             "compressed checkpoints only")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{spec}: compressed-tensors config without config_groups")
    schemes = {_weight_scheme(spec, fmt, name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise ModelLoadError(f"{spec}: its config groups quantize the weights in different ways "
                             f"({', '.join(s.describe() for s in schemes)}); batchrun takes one scheme")
    return schemes.pop()


def _weight_scheme(spec: str, fmt: str, name: str, group: object) -> StoredScheme:
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{spec}: config group {name!r} has no weights scheme")
    bits = FORMAT_BITS[fmt]
    why = None
    if weights.get("type", "int") != "int" or weights.get("num_bits") != bits:
        why = f"{weights.get('num_bits')}-bit {weights.get('type')} weights in format {fmt}"
    elif not weights.get("symmetric", True):
        why = "asymmetric weights (zero points)"
    elif weights.get("strategy") not in ("channel", "group"):
        why = f"weight strategy {weights.get('strategy')!r}"
    elif weights.get("actorder") not in (None, "weight"):
        why = f"activation-ordered groups (actorder {weights.get('actorder')!r})"
    elif weights.get("dynamic"):
        why = "dynamic weight scales"
    if why:
        raise ModelLoadError(f"{spec}: config group {name!r} has {why}, which batchrun does not run (it takes "
                             "symmetric int8 and int4 weights per channel or per group)")
    size = weights.get("group_size") if weights["strategy"] == "group" else None
    if size is not None and (not isinstance(size, int) or size <= 0):
        raise ModelLoadError(f"{spec}: config group {name!r} has group_size {size!r}")
    return StoredScheme(bits, size)


def linear_stem(name: str, names: set[str]) -> str | None:
    """`X.` when tensor `name` holds quantized linear X's integers (X.weight beside X.weight_scale, X.weight_packed)."""
    stem, _, leaf = name.rpartition(".")
    if leaf == "weight_packed" or (leaf == "weight" and f"{stem}.weight_scale" in names):
        return stem + "."
    return None


def stored_tensors(files: list[Path]) -> Iterator[tuple[str, Callable[[], torch.Tensor | QuantizedWeight]]]:
    """(name, read it) pairs for the loader: each quantized linear once, as `X.weight`, a QuantizedWeight."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    names = set(where)
    for name, file in where.items():
        stem = linear_stem(name, names)
        if stem is not None:
            yield stem + "weight", functools.partial(_read_linear, where, stem)
        elif name.rpartition(".")[2] not in SIDE_TENSORS:
            yield name, functools.partial(_read, file, name)


def _read(file: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name)


def _read_linear(where: dict[str, Path], stem: str) -> QuantizedWeight:
    import torch

    from batchrun.kernels.layouts.quant_weight import QuantizedWeight

    scale = _read(where[stem + "weight_scale"], stem + "weight_scale").to(torch.float32)
    if stem + "weight_packed" in where:
        packed = _read(where[stem + "weight_packed"], stem + "weight_packed")
        out_features, words = packed.shape
        in_features = words * 8
        if stem + "weight_shape" in where:
            shape = tuple(int(v) for v in _read(where[stem + "weight_shape"], stem + "weight_shape").tolist())
            if shape != (out_features, in_features):
                raise ModelLoadError(f"{stem}weight_packed holds {out_features}x{in_features} values for a "
                                     f"{shape[0]}x{shape[1]} weight (padded rows are not supported)")
        if packed.dtype != torch.int32:
            raise ModelLoadError(f"{stem}weight_packed is {packed.dtype}, not int32")
        # little-endian bytes of word j: inputs 8j + 2b (low nibble) and 8j + 2b + 1 (high) in byte b, as u = q + 8
        qweight = packed.contiguous().view(torch.uint8) if sys.byteorder == "little" else _bytes_big_endian(packed)
        scale = _per_group(scale, out_features, in_features, stem)
        return QuantizedWeight(4, qweight, scale, -8.0 * scale, in_features // scale.shape[1])
    q = _read(where[stem + "weight"], stem + "weight")
    if q.dtype != torch.int8:
        raise ModelLoadError(f"{stem}weight is {q.dtype}, not int8, beside a weight_scale")
    out_features, in_features = q.shape
    scale = _per_group(scale, out_features, in_features, stem)
    return QuantizedWeight(8, q, scale, None, in_features // scale.shape[1])


def _per_group(scale: torch.Tensor, out_features: int, in_features: int, stem: str) -> torch.Tensor:
    scale = scale.reshape(out_features, -1) if scale.numel() % out_features == 0 else scale
    if scale.dim() != 2 or scale.shape[0] != out_features or in_features % scale.shape[1]:
        raise ModelLoadError(f"{stem}weight_scale of shape {tuple(scale.shape)} does not fit a "
                             f"{out_features}x{in_features} weight")
    return scale.contiguous()


def _bytes_big_endian(packed: torch.Tensor) -> torch.Tensor:
    import torch

    words = packed.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=2).reshape(packed.shape[0], -1).to(
        torch.uint8)


def held_bytes(name: str, shape: tuple[int, ...], scale_shape: tuple[int, ...], element_size: int) -> int:
    """Bytes held for quantized linear `name`: packed, or in the model's dtype for a module kept unquantized."""
    from batchrun.kernels.cpu.quant import packed_nbytes
    from batchrun.model.quant.linear import is_quantized_linear_weight

    bits = 4 if name.endswith(".weight_packed") else 8
    out_features, in_features = shape[0], shape[1] * (8 if bits == 4 else 1)
    if not is_quantized_linear_weight(name.rpartition(".")[0] + ".weight", (out_features, in_features)):
        return out_features * in_features * element_size
    groups = int(scale_shape[-1]) if len(scale_shape) == 2 else 1
    return packed_nbytes(bits, out_features, in_features, in_features // max(1, groups))
