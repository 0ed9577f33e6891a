"""The blocks every family is built from: norms, rotary tables, attention, the gated MLP, the decoder layers and the
causal LM. A forward takes the step's tokens as one flat batch and its ForwardContext; a layer takes (x, residual),
the hidden state being residual + x, and the add happens inside the next norm."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import elementwise
from batchrun.kernels.cpu import logits as cpu_logits
from batchrun.kernels.cpu import sampling as cpu_sampling
from batchrun.model.layers.context import ForwardContext
from batchrun.model.layers.linear import PackedLinear
from batchrun.model.layers.ops import Rotary, TorchOps
from batchrun.model.quant.linear import QuantLinear
from batchrun.model.sampling.batch import SamplingBatch
from batchrun.model.sampling.sampler import uniform


class RMSNorm(nn.Module):
    """weight * x / rms(x); with a residual, (norm(h), h) for h = residual + x. Gemma's 1 + weight is folded at load."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def fold_offset(self) -> None:
        if self.offset:
            with torch.no_grad():
                self.weight.add_(self.offset)
            self.offset = 0.0

    def forward(self, x: torch.Tensor, ops: TorchOps, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


# ---- rotary embeddings -------------------------------------------------------------------------------------------


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    return params


def rope_tables(config: PretrainedConfig, head_dim: int, max_pos: int,
                layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_pos, head_dim x partial_rotary_factor] in fp32, by transformers' rope initialisation. Dynamic-NTK
    is fixed at max_position_embeddings (a rescale would change cached K); LongRoPE picks its factors by position,
    unlike transformers for prompts past original_max_position_embeddings (docs/models.md, Limits)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    kwargs = {"layer_type": layer_type} if layer_type is not None and layer_type in (
        getattr(config, "rope_parameters", None) or {}) else {}
    pos = torch.arange(max_pos, dtype=torch.float32)
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
        freqs = pos[:, None] * inv_freq.float()[None, :]
    elif rope_type == "longrope":
        short, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        original = params["original_max_position_embeddings"]
        long, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=original + 1, **kwargs)
        inv_freq = torch.where((pos >= original)[:, None], long.float()[None, :], short.float()[None, :])
        freqs = pos[:, None] * inv_freq
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
        freqs = pos[:, None] * inv_freq.float()[None, :]
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


# ---- attention ---------------------------------------------------------------------------------------------------


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window (None: global), from `layer_types`, else `sliding_window` on every layer."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types[: config.num_hidden_layers]]
    return [window] * config.num_hidden_layers


class Attention(nn.Module):
    """Self-attention over the paged KV pool, q|k|v fused. qk_norm: "head" (Qwen3, Gemma 3) or "proj" (OLMo 2);
    window None: global; softcap: Gemma 2's; rope: which rotary table (Gemma 3's sliding layers: "local")."""

    def __init__(self, config: PretrainedConfig, layer: int, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: str | None = None, norm_offset: float = 0.0, scale: float | None = None,
                 window: int | None = None, softcap: float | None = None, rope: str = "global") -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else float(scale)
        self.window = int(window) if window else 0  # 0: global (the kernels' convention)
        self.softcap = float(softcap) if softcap else 0.0
        self.rope = rope
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        eps = config.rms_norm_eps
        if qk_norm not in (None, "head", "proj"):
            raise ValueError(f"qk_norm must be None, 'head' or 'proj', got {qk_norm!r}")
        self.qk_norm = qk_norm
        q_dim, k_dim = (self.head_dim, self.head_dim) if qk_norm == "head" else (self.q_size, self.kv_size)
        self.q_norm = RMSNorm(q_dim, eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(k_dim, eps, norm_offset) if qk_norm else None

    def shards(self) -> dict[str, tuple[str, int]]:
        return {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", self.q_size),
                "v_proj": ("qkv_proj", self.q_size + self.kv_size)}

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "proj":  # (the ops read a slice of the rows in place where they can)
            q, k = self.q_norm(q, ctx.ops), self.k_norm(k, ctx.ops)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q, ctx.ops), self.k_norm(k, ctx.ops)
        q, k = ctx.ops.apply_rope(q, k, ctx.rotary.of(self.rope))
        o = ctx.backend.forward(q, k, v, ctx.kv_cache[self.layer], ctx.attn, self.scale, window=self.window,
                                softcap=self.softcap)
        return self.o_proj(o.reshape(-1, self.q_size))


# ---- MLP ---------------------------------------------------------------------------------------------------------

# transformers' activation names -> the op of `ops` that applies it to a fused gate|up projection
GATED_ACTIVATIONS = {"silu": "silu_mul", "swish": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul",
                     "gelu_tanh": "gelu_tanh_mul"}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate|up fused: SwiGLU (silu) or GeGLU (tanh-approximated gelu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} (batchrun supports "
                             f"{', '.join(sorted(GATED_ACTIVATIONS))})")
        self.act = GATED_ACTIVATIONS[activation]
        self.inter = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def shards(self) -> dict[str, tuple[str, int]]:
        return {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", self.inter)}

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        rows = x.shape[0]
        act = getattr(ops, self.act)
        chunk = mlp_chunk_rows(rows, 2 * self.inter * x.element_size()) if x.device.type == "cpu" else rows
        if chunk >= rows:
            return self.down_proj(act(self.gate_up_proj(x)))
        out = x.new_empty(rows, self.down_proj.out_features)
        for start in range(0, rows, chunk):
            part = x[start : start + chunk]
            out[start : start + chunk] = self.down_proj(act(self.gate_up_proj(part)))
        return out


# A prefill's gate|up activations past this size run in row chunks: glibc maps larger blocks fresh from the kernel
# on every call (page faults in every layer), while chunks reuse the heap and stay in cache. A row's arithmetic is
# unchanged (linears compute rows independently; chunks have at least 2 rows).
MLP_CHUNK_BYTES = 32 * 2**20


def mlp_chunk_rows(rows: int, row_bytes: int) -> int:
    """All rows while their gate|up activations fit MLP_CHUNK_BYTES, else a power of two within half of it."""
    if rows * row_bytes <= MLP_CHUNK_BYTES:
        return rows
    return 1 << max(1, (MLP_CHUNK_BYTES // 2 // row_bytes).bit_length() - 1)


# ---- decoder layers ----------------------------------------------------------------------------------------------
# Each takes (x, residual) with the hidden state residual + x (the first layer: residual None, x the embeddings)
# and returns (its output, the residual stream before that output is added), so layer i's output is residual + x.


def start_residual(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, ops: TorchOps):
    """(norm(h), h) for the hidden state h = residual + x, with h in the ops' residual dtype."""
    if residual is None:
        return norm(x, ops), x.to(ops.residual_dtype(x.dtype))
    return norm(x, ops, residual)


class PreNormLayer(nn.Module):
    """h += attn(norm(h)); h += mlp(norm(h)). residual_scale: Granite's multiplier on each block's output."""

    def __init__(self, config: PretrainedConfig, attn: Attention, mlp: nn.Module, residual_scale: float = 1.0) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_scale = float(residual_scale)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        h, residual = start_residual(x, residual, self.input_layernorm, ctx.ops)
        h = self.self_attn(h, ctx)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        h, residual = self.post_attention_layernorm(h, ctx.ops, residual)
        h = self.mlp(h, ctx.ops)
        if self.residual_scale != 1.0:
            h = h * self.residual_scale
        return h, residual


class SandwichLayer(nn.Module):
    """h += post_norm(attn(norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h))): Gemma 2 and 3."""

    def __init__(self, config: PretrainedConfig, attn: Attention, mlp: nn.Module, norm_offset: float = 0.0) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(dim, eps, norm_offset)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, norm_offset)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, norm_offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        h, residual = start_residual(x, residual, self.input_layernorm, ctx.ops)
        h = self.post_attention_layernorm(self.self_attn(h, ctx), ctx.ops)
        h, residual = self.pre_feedforward_layernorm(h, ctx.ops, residual)
        return self.post_feedforward_layernorm(self.mlp(h, ctx.ops), ctx.ops), residual


class PostNormLayer(nn.Module):
    """h += norm(attn(h)); h += norm(mlp(h)): OLMo 2 (no norm before a block, one after each)."""

    def __init__(self, config: PretrainedConfig, attn: Attention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        h = x.to(ctx.ops.residual_dtype(x.dtype)) if residual is None else residual + x
        a = self.post_attention_layernorm(self.self_attn(h.to(x.dtype), ctx), ctx.ops)
        residual = h + a
        return self.post_feedforward_layernorm(self.mlp(residual.to(x.dtype), ctx.ops), ctx.ops), residual


# ---- the causal LM -----------------------------------------------------------------------------------------------


def pooling_architecture(config: PretrainedConfig) -> str | None:
    """"classify" for a `*ForSequenceClassification` checkpoint, "embed" for a bare `*Model`, else None."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    return "classify" if arch.endswith("ForSequenceClassification") else "embed" if arch.endswith("Model") else None


class CausalLM(nn.Module, metaclass=ABCMeta):
    """Embeddings, the family's layers (`make_layer`), the final norm and the lm_head, with the family's scalings."""

    embed_scale: float | None = None
    embed_scale_in_dtype = False  # Gemma multiplies by a tensor of the model's dtype (rounded), Granite by a float
    logits_divisor: float | None = None
    final_softcap: float | None = None
    norm_offset: float = 0.0

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.norm_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # a pooling checkpoint (`*ForSequenceClassification`, a bare `*Model`) has no lm_head: the embeddings stand in
        self.pooling_only = pooling_architecture(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False) \
            if self.pooling_only == "classify" else None
        self.tie_weights()
        self.cos = self.sin = torch.empty(0)
        self.rope_variants: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._embed_multiplier: float | None = None
        # the step's forward in one native call where it applies (native_layers.py; set by the runner, else None)
        self.native_layers = None
        # an fp32 lm_head's bf16 screen for greedy_tokens (keep_lm_screen; None: greedy_f32 reads the whole head)
        self.lm_screen: tuple[torch.Tensor, torch.Tensor] | None = None

    @abstractmethod
    def make_layer(self, config: PretrainedConfig, layer: int) -> nn.Module:
        """Decoder layer `layer` of this family (each family's class composes it from the blocks above)."""

    def rope_layer_types(self) -> dict[str, str | None]:
        """Rotary table name -> the config's layer type its parameters come from (None: the config's only set)."""
        return {"global": None}

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings or self.pooling_only:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def classifier(self) -> nn.Module | None:
        """The sequence classification head over a pooled hidden state (None: the model has none)."""
        return self.score

    def finish_load(self) -> None:
        """After the checkpoint's weights are in, before the cast: fold the norms' offsets into their weights."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fold_offset()

    def rename_checkpoint(self, name: str) -> str:
        return name

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]]
                           ) -> Iterable[tuple[str, Callable[[], torch.Tensor]]]:
        return tensors

    def weight_target(self, name: str) -> tuple[str, int] | None:
        """(our parameter, first row) of checkpoint tensor `name`, None where it has no place; fused modules by part."""
        name = self.rename_checkpoint(name.removeprefix("model."))
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        parts = name.rsplit(".", 2)
        if len(parts) == 3:
            parent, part, suffix = parts
            try:
                shards = getattr(self.get_submodule(parent), "shards", None)
            except AttributeError:
                shards = None
            if shards is not None and part in shards():
                fused, row = shards()[part]
                return f"{parent}.{fused}.{suffix}", row
        return name, 0

    @property
    def lm_weight(self) -> torch.Tensor | None:
        """The lm_head's plain weight: the embedding's when tied, an int8 lm_head's kept aside, or None."""
        if self.config.tie_word_embeddings or self.pooling_only:
            return self.embed_tokens.weight
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head.refine_weight
        return getattr(self.lm_head, "weight", None)

    @property
    def kv_window(self) -> int | None:
        """The largest window when every layer is windowed, else None (a global layer reads all K/V)."""
        windows = [layer.self_attn.window for layer in self.layers]
        return max(windows) if all(windows) else None

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def init_rope(self, max_pos: int) -> None:
        """The rotary tables, and the embedding multiplier rounded to the model's dtype as transformers does (Gemma)."""
        device = self.embed_tokens.weight.device
        for name, layer_type in self.rope_layer_types().items():
            cos, sin = rope_tables(self.config, self.head_dim, max_pos, layer_type)
            if name == "global":
                self.cos, self.sin = cos.to(device), sin.to(device)
            else:
                self.rope_variants[name] = (cos.to(device), sin.to(device))
        if self.embed_scale is not None:
            scale = torch.tensor(self.embed_scale, dtype=torch.float32)
            self._embed_multiplier = float(scale.to(self.embed_tokens.weight.dtype) if self.embed_scale_in_dtype
                                           else scale)

    def prepare(self, max_pos: int) -> None:
        """After the weights are in, cast and placed: the rotary tables, and on CUDA the experts stacked (moe.py)."""
        self.init_rope(max_pos)
        if self.embed_tokens.weight.device.type == "cuda":
            self.group_experts()

    def group_experts(self) -> int:
        return 0

    def rotary(self, positions: torch.Tensor) -> Rotary:
        dtype = self.embed_tokens.weight.dtype
        variants = {name: Rotary(positions, cos, sin, dtype) for name, (cos, sin) in self.rope_variants.items()}
        return Rotary(positions, self.cos, self.sin, dtype, variants)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]."""
        if self.native_layers is not None:
            hidden = self.native_layers.run(input_ids, ctx)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids)
        if self._embed_multiplier is not None:
            x = x * self._embed_multiplier
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm(x, ctx.ops, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits, bf16 or int8 ones with their top candidates refined; then the family's scaling and capping."""
        head = self._fused_head(hidden)
        if head is not None:  # the same three calls in one (no scaling or capping there)
            return cpu_logits.logits_bf16(hidden, *head, REFINE_TOP)
        logits = self.lm_head(hidden)
        weight = self.lm_weight
        if weight is None or (logits.dtype != torch.bfloat16 and not isinstance(self.lm_head, QuantLinear)):
            logits = logits.float()
        else:
            if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and cpu_kernels.available():
                logits, top = cpu_sampling.logits_top(logits, REFINE_TOP)  # the widening pass finds the top too
            else:
                logits = logits.float()
                top = logits.topk(REFINE_TOP, dim=-1).indices
            refine_top_logits(logits, hidden, weight, top)
        if self.logits_divisor is not None:
            logits.div_(self.logits_divisor)
        if self.final_softcap is not None:
            soft_cap_(logits, self.final_softcap)
        return logits

    def forward_greedy(self, input_ids: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(forward's hidden states, their greedy_tokens where the native call found them in the same call)."""
        head = self.greedy_head(input_ids.shape[0]) if self.native_layers is not None else None
        if head is not None:
            got = self.native_layers.run_greedy(input_ids, ctx, *head, REFINE_TOP + 1)
            if got is not None:
                return got
        return self(input_ids, ctx), None

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of compute_logits(hidden), int64, the logits never written whole: in bf16 from the
        lm_head's REFINE_TOP + 1 largest outputs (the top REFINE_TOP refined as compute_logits refines them), in fp32
        _greedy_f32. None where that does not hold (no panels, a scale or cap, a bf16 NaN) or was not measured."""
        head = self._fused_head(hidden)
        if head is None:
            return self._greedy_f32(hidden)
        # the first maximum, as argmax over the row: every other logit is at most the last value, at a later id;
        # None where a logit is NaN (compute_logits' argmax takes it as the largest: its own path)
        return cpu_logits.greedy_bf16(hidden, *head, REFINE_TOP + 1)

    def _greedy_f32(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """An fp32 model's greedy_tokens: the argmax of its lm_head on the fp32 panels, a chunk of the vocabulary at
        a time (greedy_f32; through the bf16 screen where kept), where measured (F32_MEASURED_KERNELS) and no scale
        or cap follows; else None."""
        if not (self._f32_head() and hidden.dtype == torch.float32 and hidden.dim() == 2
                and hidden.device.type == "cpu" and cpu_logits.f32_measured()):
            return None
        head = self.lm_head
        if self.lm_screen is not None:
            return cpu_logits.greedy_f32_screened(hidden, self.lm_screen, head.packed, head.out_features)
        return cpu_logits.greedy_f32(hidden, head.packed, head.out_features)

    def _f32_head(self) -> bool:
        """Whether the lm_head is fp32 panels with no bias, scale or cap after it (greedy_f32's path)."""
        head = self.lm_head
        return (type(head) is PackedLinear and head.packed.dtype == torch.float32 and head.bias is None
                and self.logits_divisor is None and self.final_softcap is None and cpu_kernels.available())

    def lm_screen_bytes(self) -> int:
        """Bytes keep_lm_screen would keep: where the fp32 greedy path holds and its screen was measured, else 0."""
        if not (self._f32_head() and cpu_logits.f32_measured() and cpu_logits.screen_measured()):
            return 0
        return self.lm_head.packed.numel() * 2 + self.lm_head.out_features * 4

    def keep_lm_screen(self) -> None:
        """Keep the lm_head's bf16 screen (cpu_logits.lm_screen): greedy_tokens then computes in fp32 only the
        outputs it cannot rule out, the same tokens."""
        head = self.lm_head
        self.lm_screen = cpu_logits.lm_screen(head.packed, head.out_features, head.in_features)

    def sampled_tokens(self, hidden: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
        """Each row's token as sampler.sample draws it from compute_logits(hidden) (no penalties, bans or grammar),
        int64, the logits never written whole; None where greedy_tokens' path does not hold or this one was not
        measured (SAMPLED_MEASURED_KERNELS)."""
        head = self._fused_head(hidden) if cpu_logits.sampled_measured() else None
        if head is None:
            return None
        return cpu_logits.sample_bf16(hidden, *head, REFINE_TOP, batch.temperature, batch.top_k, batch.top_p,
                                      batch.min_p, uniform(batch.seeds, batch.counters))

    def _fused_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """greedy_head for contiguous bf16 hidden states [rows, hidden] on a CPU, else None."""
        if hidden.dim() != 2 or hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu" \
                or not hidden.is_contiguous():
            return None
        return self.greedy_head(hidden.shape[0])

    def greedy_head(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the lm_head's bf16 panels at `rows` rows, its plain weight) where greedy_tokens' path holds, else None."""
        head = self.lm_head
        cached = self.__dict__.get("_greedy_fused_for")
        if cached is None or cached[0] is not head:
            weight = self.lm_weight
            fits = (getattr(head, "panels_for", None) is not None and weight is not None
                    and weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.device.type == "cpu"
                    and self.logits_divisor is None and self.final_softcap is None
                    and head.out_features == weight.shape[0] > REFINE_TOP and cpu_kernels.available())
            cached = self.__dict__["_greedy_fused_for"] = (head, fits)
        if not (cached[1] and cpu_logits.greedy_measured()):
            return None
        packed = head.panels_for(rows)
        return None if packed is None else (packed, self.lm_weight)


def soft_cap_(logits: torch.Tensor, cap: float) -> None:
    """logits = cap * tanh(logits / cap) in place; on a CPU by the C kernel, since torch's vector and scalar tanh
    differ in the last bit and a row's logits would depend on its batch."""
    if logits.device.type == "cpu" and cpu_kernels.available() and logits.is_contiguous():
        elementwise.tanh_cap_(logits, cap)
    else:
        logits.div_(cap).tanh_().mul_(cap)


REFINE_TOP = 8


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, top: torch.Tensor) -> None:
    """Recompute in fp32, in place, the logits at `top` (each row's k largest): bf16 logits keep 8 bits, so top
    candidates tie or swap by rounding."""
    logits.scatter_(1, top, refined_logits(hidden, weight, top))


def refined_logits(hidden: torch.Tensor, weight: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, k]: the logits at `top` [rows, k] from the plain weight, each row's the same at any row count
    (on a CPU one dot product each, by the C kernel; else a bmm, a single row beside a copy of itself: a 1-row bmm
    takes another kernel)."""
    rows = top.shape[0]
    if cpu_kernels.available() and cpu_logits.refines(hidden, weight) and top.stride(-1) == 1:
        out = torch.empty(rows, top.shape[1], dtype=torch.float32)
        cpu_logits.refine_logits(hidden, weight, top, out)
        return out
    if rows == 1:
        top, hidden = top.expand(2, -1), hidden.expand(2, -1)
    return torch.bmm(weight[top].float(), hidden.float().unsqueeze(2)).squeeze(2)[:rows]
