"""Mixtral: Mistral's attention and a sparse MoE MLP, top-k always renormalised. Its checkpoints name the block
`block_sparse_moe` and the experts' projections w1 (gate), w3 (up) and w2 (down)."""

from __future__ import annotations

import re

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, PreNormLayer, layer_windows
from batchrun.model.arch.moe import MoECausalLM, SparseMoE

_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(MoECausalLM):
    def make_layer(self, config: PretrainedConfig, layer: int) -> PreNormLayer:
        attn = Attention(config, layer, window=layer_windows(config)[layer])
        moe = SparseMoE(config.hidden_size, config.intermediate_size, config.num_local_experts,
                        config.num_experts_per_tok, normalize=True, activation=config.hidden_act)
        return PreNormLayer(config, attn, moe)

    def rename_checkpoint(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return re.sub(r"(\.experts\.\d+\.)(w[123])\.", lambda m: f"{m[1]}{_EXPERT_PROJECTIONS[m[2]]}.", name)
