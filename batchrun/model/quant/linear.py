"""Weight-only quantized linears in a model (EngineArgs.quantization; docs/quantization.md).

Which linears: those of the layers, q|k|v and o, gate|up and down, the experts' too (`_proj` modules). The
lm_head stays in the model's dtype (its logits set the greedy tokens; the embedding it is often tied to stays
too) unless EngineArgs.quantize_lm_head asks for int8 (int8_lm_head, with the top logits recomputed), and
so do MoE routers (a few outputs, and a flipped route changes a whole expert's output).

The two ways a quantized linear arrives, both at load (loader.load_weights):
- from a checkpoint tensor in the model's dtype: quantize_linear, once the linear's rows are all in (q, k and v
  fill one fused module), so that the full-precision weight goes before the next linear is read: the load holds
  the quantized model plus one linear in full precision, never the whole model twice;
- as a QuantizedWeight the tensor source hands in (a GGUF reader): quantized_linear_module(parts, bias), with
  the parts of a fused module concatenated first (concat_rows), or one module per format where they differ
  (MixedQuantLinear).
QuantLinear runs batchrun's C kernels (cpu_kernels/quant.py) on the weight repacked once; where they are not
built, or do not take the shape (inputs or groups not whole k-steps), it multiplies by the dequantized weight
(slow, exact to the layout; logged once)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import groupby

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels.layouts import quant_weight as quant
from batchrun.kernels.cpu import quant as quant_kernels

log = logging.getLogger(__name__)

# Modules that keep the model's dtype even when the linears are quantized (see the module docstring).
KEPT = ("lm_head", "gate", "shared_expert_gate")


@dataclass(frozen=True)
class QuantSpec:
    """What EngineArgs.quantization asks for: bits 8 (one group per row) or 4 (groups of group_size)."""

    bits: int
    group_size: int  # inputs per scale (group_for adapts it to a linear whose inputs it does not divide)

    @classmethod
    def parse(cls, value: str | None) -> QuantSpec | None:
        """'none' / None -> None; 'int8' and 'int4' (groups of 128), 'int4-g32' (EngineArgs' choices). int8 takes
        groups of 128 rather than one scale per row: on SmolLM2 one per row kept 96.9% top-1 agreement with bf16,
        groups of 128 97.5% (weights alone, 512 positions), for 3% more bytes."""
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
        """The bytes a linear of this shape takes once quantized to this spec (the memory plan's count)."""
        return quant_kernels.packed_nbytes(self.bits, out_features, in_features,
                                           group_for(in_features, self.group_size))

    def quantize(self, weight: torch.Tensor) -> quant.QuantizedWeight:
        group = group_for(weight.shape[1], self.group_size)
        return quant.quantize_int8(weight, group) if self.bits == 8 else quant.quantize_int4(weight, group)


def group_for(in_features: int, wanted: int) -> int:
    """The group size for a linear of `in_features` inputs: `wanted` where it divides them, else the largest
    multiple of 8 below it that does (SmolLM2's 576 inputs: 96 for 128), else one group per row."""
    for group in range(wanted, 7, -1):
        if in_features % group == 0 and group % 8 == 0:
            if group != wanted:
                log.debug("a linear of %d inputs takes groups of %d (not %d)", in_features, group, wanted)
            return group
    return in_features


class QuantLinear(nn.Module):
    """y = x W^T + b on a quantized W, in the activations' dtype, by one of three kernels (`kernel`):
    - "c": batchrun's C kernels on the weight packed once (cpu_kernels/quant.py; a CPU);
    - "triton": the Triton matmul on the weight as stored, dequantized in its inner loop (batchrun.kernels'
      quantized_linear; on CUDA, where the weight is moved at construction; on a CPU under TRITON_INTERPRET=1 in
      tests);
    - "torch": F.linear on the weight dequantized per call (slow, exact to the layout; logged once), where the C
      kernels are not built or do not take the shape.
    The bias keeps the model's dtype (a Parameter, so that a loader fills it and .to() casts and moves it)."""

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


# quantize_lm_head's format (int8, _int8_by_rows) whatever the layers' (OpenVINO's int4 exports keep it in int8
# too): the logits rank the whole vocabulary, where int4's coarser steps would move more of the top candidates
# past the refined 8
LM_HEAD_SPEC = QuantSpec(8, 128)


def int8_lm_head(model: nn.Module) -> int:
    """EngineArgs.quantize_lm_head: model.lm_head -> its int8 QuantLinear; returns the bytes it holds.

    At decode the lm_head is the largest matrix a quantized model reads (Llama-3.2-1B: 0.5 GB of bf16 beside
    1.0 GB of int8 layers). Its logits are approximate, so the model's compute_logits recomputes each row's top
    candidates from the plain weights (refine_top_logits): the embedding's when tied, which stays anyway; an
    untied lm_head's plain weight is kept for that on the module (`refine_weight`: only the top rows of it are
    read per step)."""
    linear = model.lm_head
    weight = linear.weight.detach()
    head = QuantLinear(_int8_by_rows(weight, group_for(weight.shape[1], LM_HEAD_SPEC.group_size)), linear.bias)
    if not model.config.tie_word_embeddings:
        head.refine_weight = weight
    model.lm_head = head
    return head.nbytes


class MixedQuantLinear(nn.Module):
    """A fused linear (q|k|v, gate|up) whose parts a file stores in different formats (llama.cpp's Q4_K_M keeps
    v in Q6_K beside q and k in Q4_K): one QuantLinear per run of parts in one format, their outputs side by side,
    then the bias. One copy of the outputs per call, where a single format would round the file's integers again."""

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
    """quant.quantize_int8(weight, group_size), `rows` rows at a time into the result: quantizing works in fp32
    with a few temporaries of the input's size, which for a 128k-row lm_head were GBs (Llama-3.2-1B's peak RSS
    went from 2.6 to 5.1 GiB when it was quantized whole)."""
    q = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], weight.shape[1] // group_size, dtype=torch.float32)
    for start in range(0, weight.shape[0], rows):
        part = quant.quantize_int8(weight[start : start + rows], group_size)
        q[start : start + rows], scale[start : start + rows] = part.qweight, part.scale
    return quant.QuantizedWeight(8, q, scale, None, group_size)


def quantized_linear_module(parts: list[quant.QuantizedWeight], bias: nn.Parameter | None,
                            device: torch.device | str = "cpu") -> nn.Module:
    """The seam for loaders that hold quantized weights already (GGUF, compressed-tensors): the module a linear
    becomes from its parts' weights in row order (one part for an unfused linear), to run on `device`. One
    QuantLinear where they share a format (concat_rows), else a MixedQuantLinear of one per run of parts in one
    format."""
    runs = [list(run) for _, run in groupby(parts, key=_format)]
    if len(runs) == 1:
        return QuantLinear(concat_rows(parts), bias, device)
    log.debug("a fused linear of %d parts in %d formats: one kernel call per format", len(parts), len(runs))
    return MixedQuantLinear([QuantLinear(concat_rows(run), None, device) for run in runs], bias)


def _format(weight: quant.QuantizedWeight) -> tuple:
    return weight.bits, weight.group_size, weight.offset is None, weight.shape[1]


def quantize_linear(linear: nn.Linear, spec: QuantSpec, device: torch.device | str = "cpu") -> nn.Module:
    """A linear in the model's dtype -> its QuantLinear to run on `device` (the full-precision weight is not
    kept)."""
    return QuantLinear(spec.quantize(linear.weight.detach()), linear.bias, device)


def concat_rows(parts: list[quant.QuantizedWeight]) -> quant.QuantizedWeight:
    """The parts of a fused linear (q, k, v; gate, up), in row order, as one weight: they must share bits and
    group size."""
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
    """Whether a checkpoint tensor is the weight of a linear that quantization replaces, from its name and shape
    alone (the memory plan runs before the model exists): 2-D, `<module>.weight`, the module not KEPT and not an
    embedding. A linear this misses is counted at full size: the plan errs on the safe side."""
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
    """Bytes held by the model's quantized linears (their packed weights, scales and offsets)."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))


def quantized_params(model: nn.Module) -> int:
    """The weights the quantized linears stand for (out x in each): they are no longer the model's parameters."""
    return sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantLinear))
