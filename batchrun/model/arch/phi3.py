"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layer with q|k|v and gate|up already fused in the checkpoint, partial
rotary (partial_rotary_factor) and LongRoPE where the config asks (blocks.rope_tables), and a sliding window on
every layer when the config sets one (Phi-3-mini)."""

from __future__ import annotations

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, PreNormLayer, layer_windows


class Phi3ForCausalLM(CausalLM):
    def make_layer(self, config: PretrainedConfig, layer: int) -> PreNormLayer:
        attn = Attention(config, layer, window=layer_windows(config)[layer])
        return PreNormLayer(config, attn, GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
