"""BERT and RoBERTa / XLM-RoBERTa encoders: word + token type (1 after a pair's first SEP) + absolute position
embeddings, LayerNorm, then post-LayerNorm layers (attention, GELU MLP, biases everywhere); the classification head
is dense, tanh, then a linear (BERT: its pooler and classifier; RoBERTa: its classification head). RoBERTa's
positions start at padding_idx + 1."""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from batchrun.model.arch.encoder import Encoder
from batchrun.model.errors import ModelLoadError
from batchrun.model.layers.linear import linear_act, linear_add
from batchrun.model.layers.varlen_attention import varlen_attention


class BertLayer(nn.Module):
    """x = norm(x + attn(x)); x = norm(x + mlp(x)), with q|k|v fused."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = nn.Linear(hidden, config.intermediate_size)
        self.act_name = config.hidden_act
        self.act = ACT2FN[config.hidden_act]
        self.down_proj = nn.Linear(config.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, seq_starts: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        a = varlen_attention(q, k, v, seq_starts, self.head_dim**-0.5).reshape(x.shape)
        x = self.attn_norm(linear_add(self.o_proj, a, x))
        return self.mlp_norm(linear_add(self.down_proj, linear_act(self.up_proj, x, self.act_name, self.act), x))


class BertEncoder(Encoder):
    """BertModel / BertForSequenceClassification (and sentence-transformers folders of a BertModel)."""

    layer_pattern = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
    layer_modules = {
        "attention.self.query": ("qkv", 0),
        "attention.self.key": ("qkv", 1),
        "attention.self.value": ("qkv", 2),
        "attention.output.dense": ("o_proj", 0),
        "attention.output.LayerNorm": ("attn_norm", 0),
        "intermediate.dense": ("up_proj", 0),
        "output.dense": ("down_proj", 0),
        "output.LayerNorm": ("mlp_norm", 0),
    }

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        hidden = self.hidden_size
        self.position_offset = self.first_position(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, hidden)
        self.embed_types = nn.Embedding(config.type_vocab_size, hidden)
        self.sep_token_id: int | None = None  # set from the tokenizer (build.py): pairs' second texts are type 1
        self.embed_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        if self.has_head:
            self.head_dense = nn.Linear(hidden, hidden)
            self.head_out = nn.Linear(hidden, self.num_labels)
        # "embeddings" alone: older checkpoints' position_ids / token_type_ids buffers
        self.other_modules = {"embeddings.word_embeddings": "embed_tokens",
                              "embeddings.position_embeddings": "embed_positions",
                              "embeddings.token_type_embeddings": "embed_types",
                              "embeddings.LayerNorm": "embed_norm", "embeddings": None, **self.head_modules()}

    def first_position(self, config: PretrainedConfig) -> int:
        """The position embedding row of a sequence's first token."""
        return 0

    def head_modules(self) -> dict[str, str | None]:
        """The checkpoint's head modules -> ours (a bare model's pooler has no place: it has no head)."""
        if not self.has_head:
            return {"pooler.dense": None}
        return {"pooler.dense": "head_dense", "classifier": "head_out"}

    def prepare(self, max_pos: int) -> None:
        rows = self.embed_positions.num_embeddings
        if self.position_offset + max_pos > rows:
            raise ModelLoadError(f"max_model_len={max_pos} needs position embeddings up to row "
                                 f"{self.position_offset + max_pos - 1}, and the model has {rows}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_starts: list[int]) -> torch.Tensor:
        """Packed sequences (sequence i at rows seq_starts[i]:seq_starts[i + 1], positions from 0) -> their last
        hidden states [tokens, hidden]."""
        x = self.embed_tokens(input_ids) + self.token_types(input_ids, positions)
        x = self.embed_norm(x + self.embed_positions(positions + self.position_offset))
        for layer in self.layers:
            x = layer(x, seq_starts)
        return x

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each token's type embedding: type 0, and with two types (BERT) type 1 after a sequence's first SEP, as
        the tokenizer marks the second text of a pair (a cross-encoder's query and document)."""
        if self.embed_types.num_embeddings < 2 or self.sep_token_id is None:
            return self.embed_types.weight[0]
        is_sep = (input_ids == self.sep_token_id).long()
        before = torch.cumsum(is_sep, 0) - is_sep  # SEP tokens before each token, counted over the packed rows
        first = positions == 0
        at_start = torch.cummax(torch.where(first, before, torch.zeros_like(before)), 0).values
        return self.embed_types((before - at_start > 0).long())

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        if not self.has_head:
            return super().pool_head(pooled)
        return self.head_out(torch.tanh(self.head_dense(pooled)))


class RobertaEncoder(BertEncoder):
    """RobertaModel / XLMRobertaModel and their *ForSequenceClassification: BERT's layers, positions from
    padding_idx + 1 (a pad token inside a prompt takes its ordinal position: transformers would give it
    padding_idx, and tokenizers put none there), and the classification head (dense, tanh, out_proj)."""

    def first_position(self, config: PretrainedConfig) -> int:
        return int(config.pad_token_id) + 1

    def head_modules(self) -> dict[str, str | None]:
        if not self.has_head:
            return {"pooler.dense": None}
        return {"classifier.dense": "head_dense", "classifier.out_proj": "head_out"}
