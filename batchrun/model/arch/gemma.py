"""Gemma 2 and 3 (text): sandwich norms by 1 + weight, GeGLU, embeddings x sqrt(hidden) in the model's dtype, sliding
and global layers. Gemma 2 soft-caps scores and logits; Gemma 3 norms q/k per head, with a local rope base."""

from __future__ import annotations

from transformers import PretrainedConfig

from batchrun.model.arch.blocks import Attention, CausalLM, GatedMLP, SandwichLayer, layer_windows
from batchrun.model.errors import ModelLoadError


class Gemma2ForCausalLM(CausalLM):
    norm_offset = 1.0
    embed_scale_in_dtype = True
    qk_norm: str | None = None

    def __init__(self, config: PretrainedConfig) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ModelLoadError("bidirectional Gemma (an embedding model) is not a causal LM batchrun runs")
        super().__init__(config)
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def make_layer(self, config: PretrainedConfig, layer: int) -> SandwichLayer:
        window = layer_windows(config)[layer]
        attn = Attention(config, layer, qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         qk_norm=self.qk_norm, norm_offset=self.norm_offset,
                         scale=config.query_pre_attn_scalar**-0.5, window=window,
                         softcap=getattr(config, "attn_logit_softcapping", None),
                         rope=self.rope_of(window))
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        return SandwichLayer(config, attn, mlp, norm_offset=self.norm_offset)

    def rope_of(self, window: int | None) -> str:
        return "global"


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = "head"

    def rope_layer_types(self) -> dict[str, str | None]:
        return {"global": "full_attention", "local": "sliding_attention"}

    def rope_of(self, window: int | None) -> str:
        return "local" if window else "global"
