"""ModernBERT: embeddings then LayerNorm; pre-norm layers (the first without a norm before attention), rotary
attention with a global and a local rope base, global layers every `global_attn_every_n_layers` (the config's `layer_types`)
and local ones between (each token sees local_attention // 2 keys on each side), a GeGLU MLP (Wi gives input then
gate); a final norm. LayerNorms and linears carry biases only where the config says. The classification head pools
by the config's `classifier_pooling`, then dense, activation, norm, classifier."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from batchrun.model.arch.blocks import rope_tables
from batchrun.model.arch.encoder import Encoder
from batchrun.model.layers.varlen_attention import varlen_attention

LOCAL = "sliding_attention"
GLOBAL = "full_attention"


def layer_types(config: PretrainedConfig) -> list[str]:
    """Each layer's attention: the config's `layer_types`, else every `global_attn_every_n_layers`-th layer global."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types[: config.num_hidden_layers])
    every = int(getattr(config, "global_attn_every_n_layers", 3))
    return [GLOBAL if i % every == 0 else LOCAL for i in range(config.num_hidden_layers)]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [tokens, heads, head_dim] (halves rotated) in fp32, back in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def layer_norm(config: PretrainedConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertLayer(nn.Module):
    """x += attn(norm(x)); x += mlp(norm(x)); layer 0 attends to x itself (its embeddings are normed already)."""

    def __init__(self, config: PretrainedConfig, layer: int, attention: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.attention = attention
        self.window = int(config.local_attention) if attention == LOCAL else None
        self.attn_norm = layer_norm(config) if layer > 0 else None
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=config.attention_bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=config.attention_bias)
        self.mlp_norm = layer_norm(config)
        self.inter = int(config.intermediate_size)
        self.up_gate = nn.Linear(hidden, 2 * self.inter, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_activation]
        self.down_proj = nn.Linear(self.inter, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_starts: list[int]) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.qkv(h).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = varlen_attention(q, k, v, seq_starts, self.head_dim**-0.5, self.window)
        x = x + self.o_proj(a.reshape(x.shape))
        up, gate = self.up_gate(self.mlp_norm(x)).split(self.inter, dim=-1)
        return x + self.down_proj(self.act(up) * gate)


class ModernBertEncoder(Encoder):
    """ModernBertModel / ModernBertForSequenceClassification."""

    layer_modules = {
        "attn_norm": ("attn_norm", 0),
        "attn.Wqkv": ("qkv", 0),
        "attn.Wo": ("o_proj", 0),
        "mlp_norm": ("mlp_norm", 0),
        "mlp.Wi": ("up_gate", 0),
        "mlp.Wo": ("down_proj", 0),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        hidden = self.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_norm = layer_norm(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i, t) for i, t in enumerate(layer_types(config)))
        self.norm = layer_norm(config)
        self.other_modules = {"embeddings.tok_embeddings": "embed_tokens", "embeddings.norm": "embed_norm",
                              "final_norm": "norm"}
        if self.has_head:
            self.default_pooling = str(config.classifier_pooling)
            self.head_dense = nn.Linear(hidden, hidden, bias=config.classifier_bias)
            self.head_act = ACT2FN[config.classifier_activation]
            self.head_norm = layer_norm(config)
            self.head_out = nn.Linear(hidden, self.num_labels)
            self.other_modules.update({"head.dense": "head_dense", "head.norm": "head_norm", "classifier": "head_out"})
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, max_pos: int) -> None:
        """The rotary tables of each attention kind, in the model's dtype (as transformers rounds them) on its
        device."""
        weight = self.embed_tokens.weight
        head_dim = self.hidden_size // self.config.num_attention_heads
        for kind in {layer.attention for layer in self.layers}:
            cos, sin = rope_tables(self.config, head_dim, max_pos, kind)
            self.rope[kind] = (cos.to(weight.device, weight.dtype), sin.to(weight.device, weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_starts: list[int]) -> torch.Tensor:
        """Packed sequences (sequence i at rows seq_starts[i]:seq_starts[i + 1], positions from 0) -> their last
        hidden states [tokens, hidden]."""
        x = self.embed_norm(self.embed_tokens(input_ids))
        rows = {kind: (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
                for kind, (cos, sin) in self.rope.items()}
        for layer in self.layers:
            x = layer(x, *rows[layer.attention], seq_starts)
        return self.norm(x)

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        if not self.has_head:
            return super().pool_head(pooled)
        return self.head_out(self.head_norm(self.head_act(self.head_dense(pooled))))
