"""Qwen2-MoE and Qwen3-MoE: Qwen2's or Qwen3's attention, a sparse MoE MLP on the layers the config makes sparse
(the others dense), top-k renormalised per norm_topk_prob; Qwen2-MoE adds a gated shared expert."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, GatedMLP, PreNormLayer, layer_windows
from batchrun.model.arch.moe import MoECausalLM, SparseMoE


class Qwen2MoeForCausalLM(MoECausalLM):
    def make_layer(self, config: PretrainedConfig, layer: int) -> PreNormLayer:
        return PreNormLayer(config, self.make_attention(config, layer), self.make_mlp(config, layer))

    def make_attention(self, config: PretrainedConfig, layer: int) -> Attention:
        return Attention(config, layer, qkv_bias=config.qkv_bias, window=layer_windows(config)[layer])

    def make_mlp(self, config: PretrainedConfig, layer: int) -> nn.Module:
        sparse = layer not in (config.mlp_only_layers or []) and config.num_experts > 0 \
            and (layer + 1) % config.decoder_sparse_step == 0
        if not sparse:
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, normalize=config.norm_topk_prob, activation=config.hidden_act,
                         shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    def make_attention(self, config: PretrainedConfig, layer: int) -> Attention:
        return Attention(config, layer, qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm="head",
                         window=layer_windows(config)[layer])
