"""Quantized linears (EngineArgs.quantization; docs/quantization.md): the layers' linears, quantized as soon as their
rows are in or arriving quantized from a reader, so a load never holds the model twice; KEPT modules stay as they are."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import groupby

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels.cpu import quant as quant_kernels
from batchrun.kernels.layouts import quant_weight as quant

log = logging.getLogger(__name__)

# Modules that keep the model's dtype when the linears are quantized: their outputs pick tokens or routes.
KEPT = ("lm_head", "gate", "shared_expert_gate")


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int  # inputs per scale (group_for adapts it to a linear whose inputs it does not divide)

    @classmethod
    def parse(cls, value: str | None) -> QuantSpec | None:
        """'none' / 'gguf' / None -> None; 'int8' and 'int4' in groups of 128, 'int4-g32' in groups of 32."""
        if value in (None, "none", "gguf"):  # gguf: the file's own quantized weights (loader.load_model)
            return None
        if value == "int8":
            return cls(8, 128)
        if value == "int4":
            return cls(4, 128)
        if value == "int4-g32":
            return cls(4, 32)
        raise ValueError(f"quantization must be none, int8, int4 or int4-g32, got {value!r}")

    def held_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes a linear of this shape takes packed (the memory plan's count)."""
        return quant_kernels.packed_nbytes(self.bits, out_features, in_features,
                                           group_for(in_features, self.group_size))

    def quantize(self, weight: torch.Tensor) -> quant.QuantizedWeight:
        group = group_for(weight.shape[1], self.group_size)
        return quant.quantize_int8(weight, group) if self.bits == 8 else quant.quantize_int4(weight, group)


def group_for(in_features: int, wanted: int) -> int:
    """`wanted` where it divides the inputs, else the largest multiple of 8 below it that does, else the whole row."""
    for group in range(wanted, 7, -1):
        if in_features % group == 0 and group % 8 == 0:
            if group != wanted:
                log.debug("a linear of %d inputs takes groups of %d (not %d)", in_features, group, wanted)
            return group
    return in_features


class QuantLinear(nn.Module):
    """y = x W^T + b on a quantized W: `kernel` "c" (C kernels, W packed once), "triton" (CUDA), or "torch" (W
    dequantized per call: slow, logged) where the others do not take the shape. The bias keeps the model's dtype."""

    # when set, the kernel every QuantLinear takes whatever its device (tests run "triton" on a CPU under
    # TRITON_INTERPRET=1, and "torch" as the reference of a whole model)
    default_kernel: str | None = None

    def __init__(self, weight: quant.QuantizedWeight, bias: nn.Parameter | None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group_size = weight.bits, weight.group_size
        self.bias = bias
        self.refine_weight: torch.Tensor | None = None  # an untied lm_head's plain weight (quantize_lm_head)
        device = torch.device(device)
        # plain attributes, not buffers: model.to(dtype) must not cast the scales or the integers
        self.packed: quant_kernels.PackedQuantWeight | None = None
        self.weight_ref: quant.QuantizedWeight | None = None
        self.kernel = self.default_kernel or ("triton" if device.type != "cpu" else "c")
        why_not = None  # why the chosen kernel cannot take this weight
        if self.kernel == "c" and not quant_kernels.available():
            why_not = "the C kernels are not built"
        elif self.kernel == "c" and not quant_kernels.supports(weight):
            why_not = f"the kernels take inputs and groups in multiples of {4 if weight.bits == 8 else 8}"
        elif self.kernel == "triton" and weight.group_size % 16:
            why_not = f"the Triton kernel takes groups of a multiple of 16 inputs, not {weight.group_size}"
        if why_not:
            log.warning("a %dx%d int%d linear runs on torch (dequantized per call: slow): %s", *weight.shape,
                        weight.bits, why_not)
            self.kernel = "torch"
        if self.kernel == "c":
            self.packed = quant_kernels.pack(weight)
            self.plain = quant_kernels.kernel() == "plain"  # asked once, not per call
        else:
            self.weight_ref = weight.to(device)
        if self.kernel == "triton":
            from batchrun.kernels.triton import quantized_linear  # Triton imported only where it runs

            self.triton_linear = quantized_linear

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else self.weight_ref.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.kernel == "c":
            out = quant_kernels.linear(flat, self.packed, self.bias, plain=self.plain)
        elif self.kernel == "triton":
            out = self.triton_linear(flat, self.weight_ref)
            if self.bias is not None:
                out += self.bias.to(out.dtype)
        else:
            out = F.linear(flat, quant.dequantize(self.weight_ref).to(x.dtype), self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, " \
               f"group_size={self.group_size}, kernel={self.kernel}"


# quantize_lm_head's format whatever the layers': int4's coarser steps would move more top candidates past the
# refined 8
LM_HEAD_SPEC = QuantSpec(8, 128)


def int8_lm_head(model: nn.Module) -> int:
    """quantize_lm_head: the lm_head in int8, its top logits refined from the plain weights; returns its bytes."""
    linear = model.lm_head
    weight = linear.weight.detach()
    head = QuantLinear(_int8_by_rows(weight, group_for(weight.shape[1], LM_HEAD_SPEC.group_size)), linear.bias)
    if not model.config.tie_word_embeddings:
        head.refine_weight = weight
    model.lm_head = head
    return head.nbytes


class MixedQuantLinear(nn.Module):
    """A fused linear stored in mixed formats (Q4_K_M): one QuantLinear per format, outputs side by side."""

    def __init__(self, parts: list[QuantLinear], bias: nn.Parameter | None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = bias  # the whole module's, added after the parts (a loader may still fill it)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def _int8_by_rows(weight: torch.Tensor, group_size: int, rows: int = 4096) -> quant.QuantizedWeight:
    """quantize_int8 by blocks of rows: whole, a large lm_head's fp32 temporaries take GBs."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], weight.shape[1] // group_size, dtype=torch.float32)
    for start in range(0, weight.shape[0], rows):
        part = quant.quantize_int8(weight[start : start + rows], group_size)
        q[start : start + rows], scale[start : start + rows] = part.qweight, part.scale
    return quant.QuantizedWeight(8, q, scale, None, group_size)


def quantized_linear_module(parts: list[quant.QuantizedWeight], bias: nn.Parameter | None,
                            device: torch.device | str = "cpu") -> nn.Module:
    """The module a linear becomes from quantized parts in row order (GGUF, compressed-tensors)."""
    runs = [list(run) for _, run in groupby(parts, key=_format)]
    if len(runs) == 1:
        return QuantLinear(concat_rows(parts), bias, device)
    log.debug("a fused linear of %d parts in %d formats: one kernel call per format", len(parts), len(runs))
    return MixedQuantLinear([QuantLinear(concat_rows(run), None, device) for run in runs], bias)


def _format(weight: quant.QuantizedWeight) -> tuple:
    return weight.bits, weight.group_size, weight.offset is None, weight.shape[1]


def quantize_linear(linear: nn.Linear, spec: QuantSpec, device: torch.device | str = "cpu") -> nn.Module:
    return QuantLinear(spec.quantize(linear.weight.detach()), linear.bias, device)


def concat_rows(parts: list[quant.QuantizedWeight]) -> quant.QuantizedWeight:
    """A fused linear's parts (q, k, v; gate, up) in row order as one weight; they must share bits and groups."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(p.bits != first.bits or p.group_size != first.group_size or p.shape[1] != first.shape[1]
           for p in parts):
        raise ValueError("the parts of a fused linear are quantized alike (bits, group size, inputs)")
    offset = None if first.offset is None else torch.cat([p.offset for p in parts])
    return quant.QuantizedWeight(first.bits, torch.cat([p.qweight for p in parts]),
                                 torch.cat([p.scale for p in parts]), offset, first.group_size)


def is_quantized_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint tensor is a weight quantization replaces, by name and shape (a miss counts full size)."""
    parts = name.split(".")
    return (len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] not in KEPT
            and "embed" not in parts[-2] and parts[-2] not in ("wte", "wpe"))


def linear_targets(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Weight parameter name -> (parent module, attribute) of every linear that is quantized (not KEPT)."""
    out = {}
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and name not in KEPT:
                out[f"{parent_name}.{name}.weight" if parent_name else f"{name}.weight"] = (parent, name)
    return out


def quantized_bytes(model: nn.Module) -> int:
    return sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))


def quantized_params(model: nn.Module) -> int:
    return sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
