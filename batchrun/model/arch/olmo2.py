"""OLMo 2: no norm before a block, one after each (PostNormLayer), and q and k normalised over the whole
projection (all heads at once), before the rotary embedding."""

from __future__ import annotations

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, PostNormLayer


class Olmo2ForCausalLM(CausalLM):
    def make_layer(self, config: PretrainedConfig, layer: int) -> PostNormLayer:
        attn = Attention(config, layer, qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm="proj")
        return PostNormLayer(config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
