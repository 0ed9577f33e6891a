"""Llama, and the families that are Llama with a switch: Mistral (a window on every layer), Qwen2 / Qwen2.5 (q/k/v
bias), Qwen3 (per-head q/k norms, explicit head_dim). Rope scaling is the rotary tables' (blocks.rope_tables)."""

from __future__ import annotations

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, PreNormLayer, layer_windows


class LlamaForCausalLM(CausalLM):
    def make_layer(self, config: PretrainedConfig, layer: int) -> PreNormLayer:
        qwen2 = config.model_type == "qwen2"
        attn = Attention(config, layer,
                         qkv_bias=qwen2 or bool(getattr(config, "attention_bias", False)),
                         o_bias=bool(getattr(config, "attention_bias", False)) and not qwen2,
                         qk_norm="head" if config.model_type == "qwen3" else None,
                         window=layer_windows(config)[layer])
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       bias=bool(getattr(config, "mlp_bias", False)))
        return PreNormLayer(config, attn, mlp)
