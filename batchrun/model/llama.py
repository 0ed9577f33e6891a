"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch of tokens and the paged KV pool.

One forward takes the step's tokens of every sequence as one flat batch ([num_tokens, hidden]) and the
step's ForwardContext; only attention needs to know where one sequence ends and the next begins, and it
reads that from the context's `AttentionMetadata`. Q/K/V and gate/up projections are fused at load time
(one matmul each instead of three and two). The element-wise ops (the context's `ops`, chosen at load)
follow transformers' modules op for op, or on fp32 CPU tensors do the same arithmetic in one fused C pass,
so fp32 logits match closely (tests/test_parity.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchrun.model import cpu_kernels
from batchrun.model.context import ForwardContext
from batchrun.model.cpu_kernels import sampling as cpu_sampling
from batchrun.model.ops import Rotary, TorchOps


class RMSNorm(nn.Module):
    """With a residual it first adds it (h = residual + x) and returns (norm(h), h), so the residual add
    and the norm are one pass (see TorchOps.rms_norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: TorchOps, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


def rope_tables(config: PretrainedConfig, head_dim: int, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position up to max_pos, from transformers' own rope initialisation.

    Dynamic-NTK scaling is evaluated at the checkpoint's max_position_embeddings (a fixed table), since a
    per-batch rescale would change the K already in the cache.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    pos = torch.arange(max_pos, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q.contiguous(), ctx.ops), self.k_norm(k.contiguous(), ctx.ops)
        q, k = ctx.ops.apply_rope(q, k, ctx.rotary)
        o = ctx.backend.forward(q, k, v, ctx.kv_cache[self.layer], ctx.attn, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (batchrun supports silu)")

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        rows = x.shape[0]
        chunk = mlp_chunk_rows(rows, 2 * self.inter * x.element_size()) if x.device.type == "cpu" else rows
        if chunk >= rows:
            return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))
        out = x.new_empty(rows, self.down_proj.out_features)
        for start in range(0, rows, chunk):
            part = x[start : start + chunk]
            out[start : start + chunk] = self.down_proj(ops.silu_mul(self.gate_up_proj(part)))
        return out


# A prefill's gate|up activations, [rows, 2 x intermediate], are the largest tensor of a forward: 50 MB for 4096
# rows of SmolLM2 in fp32. glibc's malloc maps anything over 32 MB fresh from the kernel on every call (its
# mmap threshold stops rising there), so each layer page-faulted it in again: a 4096-token fp32 prefill step
# took 470,000-510,000 page faults (measured on the second to fifth such step of a process), 4,700-83,000 with
# the chunks. In row chunks under MLP_CHUNK_BYTES the activations are reused from the heap and stay in cache
# between the two matmuls; each row's arithmetic is unchanged (a linear computes rows independently;
# batch-invariant linears see at least 2 rows or pad to them). Measured on 30 MLPs of SmolLM2's shapes at 4096
# rows, fp32, oneDNN, 2 threads, three repeats: 1024-row chunks took 0.75-0.92x the time of one call, with no
# page faults. bf16 stays whole below the limit (its activations are half the size, and its
# AMX kernels ran 1.3x faster on 4096 rows than on 1024-row chunks).
MLP_CHUNK_BYTES = 32 * 2**20


def mlp_chunk_rows(rows: int, row_bytes: int) -> int:
    """Rows per MLP call: all of them while their gate|up activations fit MLP_CHUNK_BYTES, else a power of two
    that keeps each chunk's under half of it."""
    if rows * row_bytes <= MLP_CHUNK_BYTES:
        return rows
    return 1 << max(1, (MLP_CHUNK_BYTES // 2 // row_bytes).bit_length() - 1)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, qkv_bias, qk_norm)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext):
        """(x, residual) -> (mlp output, residual stream before it); the residual adds happen in the
        norms, so layer i's output is residual + x (first layer: residual None, x the embeddings)."""
        if residual is None:
            h = self.input_layernorm(x, ctx.ops)
            residual = x.to(ctx.ops.residual_dtype(x.dtype))
        else:
            h, residual = self.input_layernorm(x, ctx.ops, residual)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm(h, ctx.ops, residual)
        return self.mlp(h, ctx.ops), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, explicit head_dim)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        qk_norm = config.model_type == "qwen3"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.cos = self.sin = torch.empty(0)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def lm_weight(self) -> torch.Tensor | None:
        """The lm_head's plain weight: the embedding's when tied (a oneDNN lm_head keeps only its reordered
        copy, cpu_linear.py), else the module's own if it still has one."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        return getattr(self.lm_head, "weight", None)

    def init_rope(self, max_pos: int) -> None:
        """cos/sin tables for positions < max_pos, on the model's device, in fp32."""
        cos, sin = rope_tables(self.config, self.layers[0].self_attn.head_dim, max_pos)
        device = self.embed_tokens.weight.device
        self.cos, self.sin = cos.to(device), sin.to(device)

    def rotary(self, positions: torch.Tensor) -> Rotary:
        """The rotary embedding of a step's positions (for its ForwardContext)."""
        return Rotary(positions, self.cos, self.sin, self.embed_tokens.weight.dtype)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm(x, ctx.ops, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32; from a bf16 model with its top candidates recomputed in fp32 (refine_top_logits)."""
        logits = self.lm_head(hidden)
        weight = self.lm_weight
        if logits.dtype != torch.bfloat16 or weight is None:
            return logits.float()
        if logits.device.type == "cpu" and cpu_kernels.available():
            logits, top = cpu_sampling.logits_top(logits, REFINE_TOP)  # the widening pass finds the top too
        else:
            logits = logits.float()
            top = logits.topk(REFINE_TOP, dim=-1).indices
        refine_top_logits(logits, hidden, weight, top)
        return logits


REFINE_TOP = 8


def refine_top_logits(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, top: torch.Tensor) -> None:
    """Recompute the logits at `top` ([rows, k]: each row's k largest of the bf16 logits) in fp32, in place.

    A bf16 matmul accumulates in fp32 but stores its result in bf16, 8 significant bits: a logit near 20 is
    stored to 1/16, so the top candidates of a step often tie or swap after rounding, and greedy decoding
    picks between them by rounding alone. The same dot products (bf16 hidden state and weight rows, so the
    products are exact) summed and kept in fp32 decide them as an fp32 accumulation would. On SmolLM2-135M
    this lifts teacher-forced top-1 agreement with the fp32 model from 97.6% (transformers' own bf16 forward
    scores the same) to above 98% (tests/test_bf16_accuracy.py), for [rows, k, hidden] of work.

    A one-row bmm takes another kernel than a bmm of 2 or more rows (different bits: measured), so a single
    row is computed next to a copy of itself, and a row's refined logits never depend on its batch."""
    rows = top.shape[0]
    if rows == 1:
        top, hidden = top.expand(2, -1), hidden.expand(2, -1)
    exact = torch.bmm(weight[top].float(), hidden.float().unsqueeze(2)).squeeze(2)
    logits.scatter_(1, top[:rows], exact[:rows])
