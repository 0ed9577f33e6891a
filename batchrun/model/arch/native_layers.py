"""A step's forward to the final norm in one native call (kernels/cpu/decoder.py) making the Python path's kernel
calls, so its bits. BATCHRUN_NATIVE_LAYERS: auto (on where measured: MEASURED_KERNELS), 1 (on), 0 (off)."""

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
from batchrun.model.arch.blocks import (
    Attention,
    CausalLM,
    GatedMLP,
    PostNormLayer,
    PreNormLayer,
    RMSNorm,
    SandwichLayer,
)
from batchrun.model.arch.moe import SparseMoE
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
MEASURED_KERNELS = ("amx", "dot")


# The layers the call runs, and the norms of each (in the order of DecoderLayer's fields; None: not in this kind).
_LAYER_KINDS = {PreNormLayer: decoder.LAYER_PRE_NORM, SandwichLayer: decoder.LAYER_SANDWICH,
                PostNormLayer: decoder.LAYER_POST_NORM}
_BLOCK_NORMS = {
    decoder.LAYER_PRE_NORM: ("input_layernorm", "post_attention_layernorm", None, None),
    decoder.LAYER_SANDWICH: ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm"),
    decoder.LAYER_POST_NORM: (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}


@dataclass
class StepAddresses:
    """A step's plan as the native call reads it: int64 ids, positions, slots; int32 block tables (bt_stride a row),
    each row's table row and key count; the fp32 rotary tables."""

    ids: int
    positions: int
    slots: int
    block_tables: int
    bt_stride: int
    row_seq: int
    row_len: int
    cos_table: int
    sin_table: int


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


def _kv_format(kv_cache: torch.Tensor) -> int:
    if is_quantized(kv_cache):
        return decoder.KV_INT8
    if is_fp8(kv_cache):
        return decoder.KV_FP8_E5M2 if kv_cache.dtype == torch.float8_e5m2 else decoder.KV_FP8_E4M3
    return decoder.KV_MODEL_DTYPE


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
    if not (is_quantized(kv_cache) or is_fp8(kv_cache) or kv_cache.dtype == dtype):
        return f"a {kv_cache.dtype} KV pool"
    if not decoder.available():
        return "the C kernels are not built"
    if model.cos.dtype != torch.float32 or model.cos.shape[-1] % 2:
        return "the rotary tables"
    embed = model.embed_tokens
    if type(embed) is not torch.nn.Embedding or not embed.weight.is_contiguous():
        return "the embeddings are not a plain table"
    if any(name != "local" or cos.dtype != torch.float32 or cos.shape[-1] != model.cos.shape[-1]
           for name, (cos, _) in model.rope_variants.items()):
        return "the rotary tables"
    if type(model.norm) is not RMSNorm or model.norm.weight.dtype != dtype or not model.norm.weight.is_contiguous():
        return "the final norm"
    return None


def _mlp_shape(mlp: torch.nn.Module) -> tuple | None:
    """(activation, the gated MLP's or shared expert's intermediate size (0: none), and for a sparse block (experts,
    top_k, normalize, an expert's intermediate size), else None) of an MLP the call runs; None where it runs none."""
    if type(mlp) is GatedMLP:
        return mlp.act, mlp.inter, None
    if type(mlp) is not SparseMoE or mlp.experts is None:
        return None
    shared = mlp.shared_expert
    if len({(e.inter, e.act) for e in mlp.experts}) != 1 \
            or (shared is not None and (type(shared) is not GatedMLP or shared.act != mlp.act)):
        return None
    return mlp.act, shared.inter if shared else 0, (mlp.num_experts, mlp.top_k, mlp.normalize, mlp.experts[0].inter)


def _mlp_linears(mlp: torch.nn.Module) -> list[torch.nn.Module]:
    """gate|up and down of a gated MLP; an MoE block's router, each expert's gate|up and down, then a shared
    expert's gate|up, down and gate."""
    if type(mlp) is GatedMLP:
        return [mlp.gate_up_proj, mlp.down_proj]
    shared = mlp.shared_expert
    return [mlp.gate, *(m for e in mlp.experts for m in (e.gate_up_proj, e.down_proj)),
            *((shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate) if shared is not None else ())]


def _layer_spec(layer: torch.nn.Module, first: torch.nn.Module, model: CausalLM, dtype: torch.dtype
                ) -> tuple[decoder.DecoderLayer, int, list[object]] | str:
    """The native description of one layer, the most rows its linears take the kernels at, and what it points
    into; or why the call cannot run it."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    kind = _LAYER_KINDS.get(type(layer))
    if kind is None or type(attn) is not Attention or attn.rope not in decoder.ROPES or _mlp_shape(mlp) is None:
        return f"a {type(layer).__name__} layer with a {type(mlp).__name__}"
    input_norm, post_norm, pre_ff_norm, post_ff_norm = (getattr(layer, name) if name else None
                                                         for name in _BLOCK_NORMS[kind])
    norms = [n for n in (input_norm, post_norm, pre_ff_norm, post_ff_norm) if n is not None] \
        + ([attn.q_norm, attn.k_norm] if attn.qk_norm else [])
    if (type(layer), attn.num_heads, attn.num_kv_heads, attn.head_dim, _mlp_shape(mlp)[0], attn.qk_norm) != \
            (type(first), first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim,
             _mlp_shape(first.mlp)[0], first.self_attn.qk_norm) \
            or any(norm.eps != model.norm.eps or norm.offset for norm in norms):
        return "layers of different shapes"
    linears = [_native_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj, *_mlp_linears(mlp))]
    weights = [norm.weight for norm in norms]
    if any(lin is None for lin in linears) or any(w.dtype != dtype or not w.is_contiguous() for w in weights):
        return "a linear or norm no C kernel takes"
    def pointer(norm: RMSNorm | None) -> int | None:
        return None if norm is None else norm.weight.data_ptr()

    qkv, o, *mlp_linears = (lin.spec for lin in linears)
    keep: list[object] = list(weights)
    none = decoder.NativeLinear
    gate_up, down, router, shared_gate, experts = none(), none(), none(), none(), None
    if type(mlp) is GatedMLP:
        gate_up, down = mlp_linears
    else:
        router, *rest = mlp_linears
        expert_linears, shared = rest[: 2 * mlp.num_experts], rest[2 * mlp.num_experts :]
        experts = (decoder.NativeLinear * len(expert_linears))(*expert_linears)
        keep.append(experts)
        if shared:  # the shared expert in the gated MLP's places
            gate_up, down, shared_gate = shared
    spec = decoder.DecoderLayer(
        qkv, o, gate_up, down, pointer(input_norm), pointer(post_norm), pointer(attn.q_norm),
        pointer(attn.k_norm), pointer(pre_ff_norm), pointer(post_ff_norm), kind, attn.window, decoder.ROPES[attn.rope],
        attn.scale, attn.softcap, getattr(layer, "residual_scale", 1.0), router,
        None if experts is None else ctypes.addressof(experts), shared_gate, _mlp_shape(mlp)[1])
    return spec, min(lin.max_rows for lin in linears), keep


class NativeLayers:
    """The model's layers as the native call's structures, built once after the linears are packed."""

    def __init__(self, shape: decoder.DecoderShape, layers: ctypes.Array, max_rows: int, dtype: torch.dtype,
                 residual_dtype: torch.dtype, widths: tuple[int, ...], keep: list[object],
                 backend: object, embed: torch.Tensor, final_norm: torch.Tensor,
                 local_tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.shape, self.layers, self.max_rows = shape, layers, max_rows
        self.dtype, self.residual_dtype = dtype, residual_dtype
        # the runner's backend it was described for (with its pool's format): another runner of the same model takes
        # the Python loop
        self.backend = backend
        # per row: x, h, q|k|v, attention, gate|up, activation; normed q, k, copied v; MoE: router logits, an
        # expert's input, the pairs' outputs
        self.widths = widths
        self._keep = keep  # what the structures point into (tensors, the experts' linears)
        self.embed, self.final_norm = embed, final_norm  # the embedding table, the final norm's weight
        self._work = torch.empty(0, dtype=dtype)
        self._residual = torch.empty(0, dtype=residual_dtype)
        self._tokens = torch.empty(max_rows, dtype=torch.int64)  # run_greedy's (a view of it, until the next step)
        self.local_tables = local_tables  # the "local" layers' cos, sin (Gemma 3; else the global ones)
        # MoE layers' routes (decoder.DecoderStep): each pair's weight; its expert, output row and the inverse; each
        # expert's first row and a cursor
        pairs, experts = max_rows * shape.top_k, shape.experts
        self._route_weights = torch.empty(pairs, dtype=torch.float32)
        self._route_index = torch.empty(3 * pairs + 2 * (experts + 1), dtype=torch.int64)

    @classmethod
    def build(cls, model: CausalLM, backend: object, ops: CpuKernelOps, kv_cache: torch.Tensor) -> NativeLayers | None:
        """The native layers of `model`, or None (logged) where its layers or settings are not what they run."""
        why = _why_not(model, backend, ops, kv_cache)
        dtype = model.embed_tokens.weight.dtype
        first = model.layers[0] if len(model.layers) else None
        specs, keep, max_rows = [], [], MAX_ROWS
        for layer in model.layers if why is None else ():
            spec = _layer_spec(layer, first, model, dtype)
            if isinstance(spec, str):
                why = spec
                break
            specs.append(spec[0])
            max_rows = min(max_rows, spec[1])
            keep += spec[2]
        if why is None and not specs:
            why = "no layers"
        shapes = [_mlp_shape(layer.mlp) for layer in model.layers] if why is None else []
        sparse = {shape[2] for shape in shapes if shape[2] is not None}
        if len(sparse) > 1:
            why = "sparse blocks of different shapes"
        if why is not None:
            log.info("decoder layers in Python: %s", why)
            return None
        attn = first.self_attn
        act = shapes[0][0]
        experts, top_k, normalize, expert_inter = sparse.pop() if sparse else (0, 0, False, 0)
        residual_dtype = ops.residual_dtype(dtype)
        shape = decoder.DecoderShape(
            hidden=model.config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            inter=expert_inter, rot=model.cos.shape[-1], block_size=kv_cache.shape[3], activation=decoder.ACTIVATIONS[act],
            kv_format=_kv_format(kv_cache),
            amx_lanes=backend.amx_lanes, bf=int(dtype == torch.bfloat16),
            res_fp32=int(residual_dtype == torch.float32), qk_proj=int(attn.qk_norm == "proj"), experts=experts,
            top_k=top_k, normalize=int(normalize), eps=model.norm.eps,
            embed_scale=model._embed_multiplier or 0.0)
        hidden = model.config.hidden_size
        widest = max(expert_inter, *(shape[1] for shape in shapes))
        widths = (hidden, hidden, attn.q_size + 2 * attn.kv_size, attn.q_size, 2 * widest, widest,
                  *((attn.q_size, attn.kv_size, attn.kv_size) if attn.qk_norm else (0, 0, 0)),
                  experts, hidden if experts else 0, top_k * hidden)
        log.info("the forward in one native call for steps of up to %d rows", max_rows)
        return cls(shape, (decoder.DecoderLayer * len(specs))(*specs), max_rows, dtype, residual_dtype, widths, keep,
                   backend, model.embed_tokens.weight, model.norm.weight,
                   model.rope_variants.get("local", (model.cos, model.sin)))

    def _layout(self, rows: int) -> list[int]:
        """Each workspace section's first element for `rows` rows, [rows, width] each from a cache line (the
        workspace grown as needed)."""
        per_line = _ALIGN // self._work.element_size()
        sizes = [-(-rows * width // per_line) * per_line for width in self.widths]
        if self._work.numel() < sum(sizes):
            self._work = torch.empty(sum(sizes), dtype=self.dtype)
        return list(itertools.accumulate(sizes[:-1], initial=0))

    def _sections(self, rows: int) -> list[int]:
        starts = self._layout(rows)  # (first: it may grow the workspace)
        base, element = self._work.data_ptr(), self._work.element_size()
        return [base + element * start for start in starts]

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """The Python path's hidden states after the final norm (a workspace view, until the next step), or None."""
        got = self._forward(input_ids, ctx, None)
        return None if got is None else got[0]

    def run_greedy(self, input_ids: torch.Tensor, ctx: ForwardContext, packed: torch.Tensor, weight: torch.Tensor,
                   top: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """run's hidden states and their greedy tokens as cpu_logits.greedy_bf16 finds them (None on a NaN)."""
        if self.dtype != torch.bfloat16:
            return None
        return self._forward(input_ids, ctx, (packed, weight, top))

    def _forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                 lm: tuple[torch.Tensor, torch.Tensor, int] | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        rows = input_ids.shape[0]
        meta = ctx.attn
        if not 0 < rows <= self.max_rows or meta.has_padding or input_ids.dim() != 1 \
                or input_ids.dtype != torch.int64 or not input_ids.is_contiguous() or ctx.backend is not self.backend:
            return None
        row_seq, row_len = meta.query_rows
        tables = meta.block_tables if meta.block_tables.is_contiguous() else meta.block_tables.contiguous()
        rotary = ctx.rotary
        plan = StepAddresses(input_ids.data_ptr(), rotary.positions.data_ptr(), meta.slot_mapping.data_ptr(),
                             tables.data_ptr(), tables.stride(0), row_seq.data_ptr(), row_len.data_ptr(),
                             rotary.cos_table.data_ptr(), rotary.sin_table.data_ptr())
        out = self.hidden_view(rows)  # (made before the call: no torch op after it)
        if lm is None:
            self.call(rows, plan, ctx.kv_cache, None)
            return out, None
        tokens = self._tokens[:rows]
        found = self.call(rows, plan, ctx.kv_cache, (lm[0].data_ptr(), lm[1].data_ptr(), lm[1].shape[0], lm[2],
                                                     tokens.data_ptr()))
        return out, tokens if found else None

    def hidden_view(self, rows: int) -> torch.Tensor:
        """Where call() leaves the hidden states: the workspace's section h, [rows, hidden]."""
        hidden, start = self.widths[0], self._layout(rows)[1]
        return self._work[start : start + rows * hidden].view(rows, hidden)

    def call(self, rows: int, plan: StepAddresses, pool: torch.Tensor,
             greedy: tuple[int, int, int, int, int] | None) -> bool:
        """The call on `rows` rows planned at `plan`; with `greedy` (panels, weight, n, top, tokens) the tokens."""
        hidden = self.widths[0]
        sections = self._sections(rows)
        if self._residual.numel() < rows * hidden:
            self._residual = torch.empty(rows * hidden, dtype=self.residual_dtype)
        pairs, index = rows * self.shape.top_k, self._route_index.data_ptr()
        step = decoder.DecoderStep(
            plan.ids, self.embed.data_ptr(), self.embed.shape[0], self.final_norm.data_ptr(), self._residual.data_ptr(),
            *sections[:9], rows, plan.positions, plan.slots, plan.cos_table, plan.sin_table,
            self.local_tables[0].data_ptr(), self.local_tables[1].data_ptr(), plan.block_tables,
            plan.row_seq, plan.row_len, plan.bt_stride, pool.data_ptr(), pool.stride(0) * pool.element_size(),
            pool.stride(1) * pool.element_size(), *(greedy or (None, None, 0, 0, None)), *sections[9:],
            self._route_weights.data_ptr(), *(index + 8 * pairs * part for part in range(4)))
        return decoder.decoder_forward(self.shape, self.layers, step)


