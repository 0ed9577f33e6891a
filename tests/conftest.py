import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Triton kernels run interpreted on machines without CUDA (set before any kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# LLM() sizes torch's threads itself (batchrun/kernels/cpu/threads.py); OMP_NUM_THREADS keeps it at the tests' count.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# Built-in models are made into a cache folder of the test session, not the user's, and it goes when the session
# ends: each holds ~560 MB (the built-in real model converted), and hundreds of runs left behind filled a disk.
if "BATCHRUN_CACHE" not in os.environ:
    os.environ["BATCHRUN_CACHE"] = tempfile.mkdtemp(prefix="batchrun-test-cache-")
    atexit.register(shutil.rmtree, os.environ["BATCHRUN_CACHE"], ignore_errors=True)

# Tiny checkpoints of each supported architecture: GQA and not, tied and untied, a head_dim that is not a
# power of two. init_std 0.05 keeps logits peaked enough that greedy parity is not decided by rounding.
ARCH_SPECS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=48, tie_word_embeddings=False),
    # the newer families (tests/test_families.py): odd GQA ratios and head dims, windows shorter than the
    # prompts, each family's own switches set away from their defaults
    "gemma2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=32,
                   sliding_window=24, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                   tie_word_embeddings=True),
    "gemma3": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                   num_hidden_layers=3, sliding_window=20,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   tie_word_embeddings=False),
    "phi3": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, sliding_window=40,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                 tie_word_embeddings=False),
    "olmo2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "granite": dict(num_attention_heads=4, num_key_value_heads=1, embedding_multiplier=3.0,
                    attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.5, tie_word_embeddings=True),
    "mixtral": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=80,
                    num_local_experts=5, num_experts_per_tok=2, sliding_window=36, tie_word_embeddings=False),
    "qwen2_moe": dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, mlp_only_layers=[1],
                      num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                      shared_expert_intermediate_size=56, norm_topk_prob=False, tie_word_embeddings=False),
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True, tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def tokenizer():
    from batchrun.model.weights.builtin import train_tokenizer

    return train_tokenizer()


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory, tokenizer):
    """make_ckpt(arch, **overrides) -> path of a tiny random checkpoint (cached per arguments)."""
    from batchrun.model.weights.builtin import make_checkpoint

    made = {}

    def make(arch: str = "llama", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            kw = {**ARCH_SPECS[arch], "init_std": 0.05, **overrides}
            made[key] = make_checkpoint(tmp_path_factory.mktemp(arch), arch, tokenizer=tokenizer, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_path(make_ckpt):
    return make_ckpt("llama")


@pytest.fixture(scope="session")
def smollm2_path():
    """builtin:smollm2-135m-instruct, dequantized once per test session into the session's cache."""
    from batchrun.model.weights.builtin import builtin_path

    return builtin_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The real model in fp32 on CPU, shared by the tests that ask it questions."""
    from batchrun import LLM

    return LLM(str(smollm2_path), dtype="float32", device="cpu", kv_cache_memory="128MiB", max_num_seqs=32)


@pytest.fixture(scope="session")
def classifier_path(tiny_llama_path, tmp_path_factory):
    """A three-label LlamaForSequenceClassification made from the tiny Llama (its score head random, seeded)."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(tiny_llama_path, num_labels=3, dtype=torch.float32)
    model.config.pad_token_id = 0
    path = tmp_path_factory.mktemp("llama-cls")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_path).save_pretrained(path)
    return path
