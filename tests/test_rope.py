"""The rotary tables (arch/blocks.py: rope_tables) against transformers' own rotary embedding modules on the same
configs, bit for bit: Llama 3.x's llama3 scaling, Qwen2.5's plain and YaRN configs, linear scaling, partial rotary,
Phi-3's LongRoPE (short factors within the original context, long past it) and Gemma 3's two tables."""

import pytest
import torch
import transformers

from batchrun.model.arch.blocks import layer_windows, rope_tables

MAX_POS = 300


def hf_cos_sin(module, positions: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, positions[None, :], **kwargs)
    return cos[0], sin[0]


CONFIGS = {
    # Llama 3.1 / 3.2: rope_type llama3 (factor 8, original context 8192)
    "llama3": (transformers.LlamaConfig, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
               dict(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192})),
    # Qwen2.5-7B-Instruct as shipped: theta 1e6, no scaling
    "qwen2.5": (transformers.Qwen2Config, transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
                dict(hidden_size=256, num_attention_heads=2, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen2.5's long-context recipe: YaRN factor 4 over 32768
    "qwen2.5-yarn": (transformers.Qwen2Config, transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
                     dict(hidden_size=256, num_attention_heads=2, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 32768})),
    "linear": (transformers.LlamaConfig, transformers.models.llama.modeling_llama.LlamaRotaryEmbedding,
               dict(hidden_size=128, num_attention_heads=2,
                    rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # Phi-4-mini: 3/4 of each head rotates
    "partial": (transformers.Phi3Config, transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding,
                dict(hidden_size=128, num_attention_heads=2, pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75})),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rope_tables_are_transformers(name):
    config_cls, module_cls, kw = CONFIGS[name]
    config = config_cls(**kw)
    head_dim = config.hidden_size // config.num_attention_heads
    cos, sin = rope_tables(config, head_dim, MAX_POS)
    ref_cos, ref_sin = hf_cos_sin(module_cls(config), torch.arange(MAX_POS))
    assert cos.shape == ref_cos.shape
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_longrope_short_factors_within_the_original_context_long_past_it():
    """Phi-3's LongRoPE: transformers rotates a forward with the short factors while its sequence fits
    original_max_position_embeddings, with the long ones past it; our table does so by position."""
    original = 64
    config = transformers.Phi3Config(
        hidden_size=64, num_attention_heads=2, pad_token_id=0, max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
                         "short_factor": [1.0 + 0.1 * i for i in range(16)],
                         "long_factor": [2.0 + 0.5 * i for i in range(16)]})
    cos, sin = rope_tables(config, 32, 200)
    module = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    short_cos, short_sin = hf_cos_sin(module, torch.arange(original))  # a forward within the original context
    assert torch.equal(cos[:original], short_cos) and torch.equal(sin[:original], short_sin)
    for p in (original, original + 1, 199):  # a decode step past it: transformers switches to the long factors
        step_cos, step_sin = hf_cos_sin(module, torch.tensor([p]))
        assert torch.equal(cos[p : p + 1], step_cos) and torch.equal(sin[p : p + 1], step_sin)
    assert not torch.equal(cos[original + 1], short_cos[0])  # (the two sets differ)


def test_gemma3_local_and_global_tables():
    config = transformers.Gemma3TextConfig(
        hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6,
        sliding_window=8, rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    module = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    for layer_type in ("full_attention", "sliding_attention"):
        cos, sin = rope_tables(config, 16, MAX_POS, layer_type)
        ref_cos, ref_sin = hf_cos_sin(module, torch.arange(MAX_POS), layer_type=layer_type)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert layer_windows(config) == [8, 8, 8, 8, 8, None]


def test_layer_windows_follow_transformers_masks():
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=32)
    assert layer_windows(mistral) == [32, 32, 32]
    assert layer_windows(transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    qwen = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    assert layer_windows(qwen) == [None, None, 16, 16]
    assert layer_windows(transformers.Qwen2Config(num_hidden_layers=2, sliding_window=16)) == [None, None]
    assert layer_windows(transformers.LlamaConfig(num_hidden_layers=2)) == [None, None]
