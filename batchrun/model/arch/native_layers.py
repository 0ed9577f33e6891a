"""A step's decoder layers in one native call (kernels/cpu/decoder.py) where it makes the Python loop's kernel calls
with the same arguments, so the same bits: pre-norm layers of attention (per-head q/k norms or none) and a gated MLP,
every linear on a C kernel at the step's row count, the C attention over a pool in the model's dtype or int8.
BATCHRUN_NATIVE_LAYERS: auto (on where it was measured, MEASURED_KERNELS), 1 (on), 0 (off)."""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
from dataclasses import dataclass

import torch

from batchrun.kernels.cpu import decoder
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.kernels.layouts.kv_rows import is_fp8, is_quantized
from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, PreNormLayer
from batchrun.model.layers.attention import TorchBackend
from batchrun.model.layers.context import ForwardContext
from batchrun.model.layers.linear import OneDNNLinear, PackedLinear
from batchrun.model.layers.ops import CpuKernelOps
from batchrun.model.quant.linear import QuantLinear

log = logging.getLogger(__name__)

# The most rows a step takes the native call with: the Python between kernels costs the same at any row count, so
# past a few hundred rows it is a small share of the step, and the workspace stays small.
MAX_ROWS = 256
_ALIGN = 64  # bytes: each workspace section starts on a cache line
# The CPU kinds (by their bf16 linear kernel, linears.bf16_kernel()) where the native call was measured faster than
# the Python loop (docs/performance.md); elsewhere the loop stays the default until it is measured there.
MEASURED_KERNELS = ("amx",)


@dataclass
class _Linear:
    spec: decoder.NativeLinear
    max_rows: int  # the most rows at which the module's own forward takes this kernel


def _native_linear(module: torch.nn.Module, dtype: torch.dtype) -> _Linear | None:
    """The kernel call `module`'s forward makes on a [rows, in] input of `dtype`, and up to how many rows."""
    bias = getattr(module, "bias", None)
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    n, k = module.out_features, module.in_features
    if isinstance(module, PackedLinear) and module.packed.dtype == dtype:
        kind = decoder.LINEAR_BF16 if dtype == torch.bfloat16 else decoder.LINEAR_F32
        return _Linear(decoder.NativeLinear(kind, n, k, module.packed.data_ptr(), bias_ptr), MAX_ROWS)
    if isinstance(module, OneDNNLinear) and module.small is not None and dtype == torch.bfloat16:
        return _Linear(decoder.NativeLinear(decoder.LINEAR_BF16, n, k, module.small.data_ptr(), bias_ptr),
                       cpu_linears.SMALL_ROWS)
    if isinstance(module, QuantLinear) and module.kernel == "c":
        w = module.packed
        return _Linear(decoder.NativeLinear(decoder.LINEAR_QUANT, n, k, w.packed.data_ptr(), bias_ptr,
                                            w.scale.data_ptr(), None if w.offset is None else w.offset.data_ptr(),
                                            w.weight_group, w.group_size, w.bits, int(module.plain)), MAX_ROWS)
    return None


def _why_not(model: CausalLM, backend: object, ops: object, kv_cache: torch.Tensor) -> str | None:
    """Why the model's layers cannot take the native call (None: they can, layer by layer checked in build)."""
    dtype = model.embed_tokens.weight.dtype
    choice = os.environ.get("BATCHRUN_NATIVE_LAYERS", "auto")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"BATCHRUN_NATIVE_LAYERS must be auto, 0 or 1, got {choice!r}")
    if choice == "0":
        return "BATCHRUN_NATIVE_LAYERS=0"
    if choice == "auto" and cpu_linears.bf16_kernel() not in MEASURED_KERNELS:
        return "not yet measured on this CPU kind (BATCHRUN_NATIVE_LAYERS=1 turns it on)"
    if not isinstance(ops, CpuKernelOps) or dtype not in (torch.float32, torch.bfloat16):
        return "the element-wise ops are not the C kernels"
    if not isinstance(backend, TorchBackend) or not backend.cpu_kernels or backend.sdpa_prefill:
        return "the attention is not the C kernels'"
    if is_fp8(kv_cache) or not (is_quantized(kv_cache) or kv_cache.dtype == dtype):
        return f"a {kv_cache.dtype} KV pool"
    if not decoder.available():
        return "the C kernels are not built"
    if model.cos.dtype != torch.float32 or model.cos.shape[-1] % 2:
        return "the rotary tables"
    return None


class NativeLayers:
    """The model's layers as the native call's structures, built once after the linears are packed."""

    def __init__(self, shape: decoder.DecoderShape, layers: ctypes.Array, max_rows: int, dtype: torch.dtype,
                 residual_dtype: torch.dtype, widths: tuple[int, ...], keep: list[torch.Tensor],
                 backend: object) -> None:
        self.shape, self.layers, self.max_rows = shape, layers, max_rows
        self.dtype, self.residual_dtype = dtype, residual_dtype
        # the runner's backend it was described for (with its pool's format): another runner of the same model takes
        # the Python loop
        self.backend = backend
        self.widths = widths  # per row: x, h, q|k|v, attention, gate|up, activation; normed q, k, copied k, v
        self._keep = keep  # the tensors the structures point into
        self._work = torch.empty(0, dtype=dtype)

    @classmethod
    def build(cls, model: CausalLM, backend: object, ops: CpuKernelOps, kv_cache: torch.Tensor) -> NativeLayers | None:
        """The native layers of `model`, or None (logged) where its layers or settings are not what they run."""
        why = _why_not(model, backend, ops, kv_cache)
        dtype = model.embed_tokens.weight.dtype
        first = model.layers[0] if len(model.layers) else None
        specs, keep, max_rows = [], [], MAX_ROWS
        for layer in model.layers if why is None else ():
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if type(layer) is not PreNormLayer or layer.residual_scale != 1.0 or type(attn) is not Attention \
                    or attn.qk_norm not in (None, "head") or attn.rope != "global" or type(mlp) is not GatedMLP:
                why = f"a {type(layer).__name__} layer"
                break
            norms = [layer.input_layernorm, layer.post_attention_layernorm, *((attn.q_norm, attn.k_norm)
                                                                                if attn.qk_norm else ())]
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.inter, mlp.act, attn.qk_norm) != \
                    (first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim,
                     first.mlp.inter, first.mlp.act, first.self_attn.qk_norm) \
                    or any(norm.eps != first.input_layernorm.eps for norm in norms):
                why = "layers of different shapes"
                break
            linears = [_native_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                          mlp.down_proj)]
            weights = [norm.weight for norm in norms]
            if any(lin is None for lin in linears) or any(w.dtype != dtype or not w.is_contiguous() for w in weights):
                why = "a linear or norm no C kernel takes"
                break
            max_rows = min([max_rows, *(lin.max_rows for lin in linears)])
            keep += weights
            input_norm, post_norm, q_norm, k_norm = [w.data_ptr() for w in weights] + [None] * (4 - len(weights))
            specs.append(decoder.DecoderLayer(*(lin.spec for lin in linears), input_norm, post_norm, q_norm, k_norm,
                                              attn.window, attn.scale, attn.softcap))
        if why is None and not specs:
            why = "no layers"
        if why is not None:
            log.info("decoder layers in Python: %s", why)
            return None
        attn, mlp = first.self_attn, first.mlp
        residual_dtype = ops.residual_dtype(dtype)
        shape = decoder.DecoderShape(
            hidden=model.config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            inter=mlp.inter, rot=model.cos.shape[-1], block_size=kv_cache.shape[3],
            activation=decoder.ACTIVATIONS[mlp.act],
            kv_format=decoder.KV_INT8 if is_quantized(kv_cache) else decoder.KV_MODEL_DTYPE,
            amx_lanes=backend.amx_lanes, bf=int(dtype == torch.bfloat16),
            res_fp32=int(residual_dtype == torch.float32), eps=first.input_layernorm.eps)
        hidden = model.config.hidden_size
        widths = (hidden, hidden, attn.q_size + 2 * attn.kv_size, attn.q_size, 2 * mlp.inter, mlp.inter,
                  *((attn.q_size, attn.kv_size, attn.kv_size, attn.kv_size) if attn.qk_norm else (0, 0, 0, 0)))
        log.info("decoder layers in one native call for steps of up to %d rows", max_rows)
        return cls(shape, (decoder.DecoderLayer * len(specs))(*specs), max_rows, dtype, residual_dtype, widths, keep,
                   backend)

    def _sections(self, rows: int) -> tuple[torch.Tensor, list[int]]:
        """The workspace for `rows` rows (grown as needed): its first section as a tensor [rows, hidden] (the output
        the step returns), and the address of each section [rows, width], each from a cache line."""
        per_line = _ALIGN // self._work.element_size()
        sizes = [-(-rows * width // per_line) * per_line for width in self.widths]
        if self._work.numel() < sum(sizes):
            self._work = torch.empty(sum(sizes), dtype=self.dtype)
        base, element = self._work.data_ptr(), self._work.element_size()
        starts = [base + element * start for start in itertools.accumulate(sizes[:-1], initial=0)]
        return self._work[: rows * self.widths[0]].view(rows, self.widths[0]), starts

    def run(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream) as the Python loop returns them, or None (the loop's)."""
        rows = x.shape[0]
        meta, pool = ctx.attn, ctx.kv_cache
        if not 0 < rows <= self.max_rows or meta.has_padding or x.dim() != 2 or x.dtype != self.dtype \
                or not x.is_contiguous() or ctx.backend is not self.backend:
            return None
        residual = x.to(self.residual_dtype)  # as start_residual makes it (x itself where the dtypes agree)
        out, sections = self._sections(rows)
        row_seq, row_len = meta.query_rows
        tables = meta.block_tables if meta.block_tables.is_contiguous() else meta.block_tables.contiguous()
        rotary = ctx.rotary
        step = decoder.DecoderStep(
            x.data_ptr(), residual.data_ptr(), *sections, rows, rotary.positions.data_ptr(),
            meta.slot_mapping.data_ptr(), rotary.cos_table.data_ptr(), rotary.sin_table.data_ptr(), tables.data_ptr(),
            row_seq.data_ptr(), row_len.data_ptr(), tables.stride(0), pool.data_ptr(),
            pool.stride(0) * pool.element_size(), pool.stride(1) * pool.element_size())
        decoder.decoder_layers(self.shape, self.layers, step)
        return out, residual
