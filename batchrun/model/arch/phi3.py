"""Phi-3 and Phi-4: Llama's layer, q|k|v and gate|up fused in the checkpoint, partial rotary and LongRoPE
(blocks.rope_tables), a sliding window on every layer when set (Phi-3-mini)."""

from __future__ import annotations

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, PreNormLayer, layer_windows


class Phi3ForCausalLM(CausalLM):
    def make_layer(self, config: PretrainedConfig, layer: int) -> PreNormLayer:
        attn = Attention(config, layer, window=layer_windows(config)[layer])
        return PreNormLayer(config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
