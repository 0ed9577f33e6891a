"""Granite 3.x dense: Llama with the config's multipliers for the embeddings, the score scale, each block's output
(residual_multiplier), and the logits (divided by logits_scaling)."""

from __future__ import annotations

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, PreNormLayer


class GraniteForCausalLM(CausalLM):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.embed_scale = config.embedding_multiplier
        self.logits_divisor = config.logits_scaling

    def make_layer(self, config: PretrainedConfig, layer: int) -> PreNormLayer:
        attn = Attention(config, layer, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         scale=config.attention_multiplier)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)
        return PreNormLayer(config, attn, mlp, residual_scale=config.residual_multiplier)
