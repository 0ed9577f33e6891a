"""ForwardContext: what a forward needs besides the token ids, built once per step and handed to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.model.layers.attention import AttentionBackend, AttentionMetadata
from batchrun.model.layers.ops import Rotary, TorchOps


@dataclass
class ForwardContext:
    attn: AttentionMetadata  # where each sequence's tokens start and end, block tables, slots
    kv_cache: torch.Tensor  # the whole pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    rotary: Rotary  # the step's positions and the model's cos/sin tables
    backend: AttentionBackend  # chosen at load
    ops: TorchOps  # the element-wise ops, chosen at load

    @property
    def positions(self) -> torch.Tensor:
        return self.rotary.positions
