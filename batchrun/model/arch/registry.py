"""The model families: the architectures each covers, its module, and what the tests verify for it (`verified`,
parametrized by families_verifying). Imports no torch; a family's module is imported only when it loads."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# What each verification means (the tests that hold it are named in tests/test_models_registry.py).
VERIFIED_CHECKS = {
    "greedy": "fp32 greedy tokens equal transformers' token for token (CPU, C kernels)",
    "logits": "fp32 prefill logits within 1e-4 of transformers'",
    "bf16": "bf16 teacher-forced top-1 agreement with the fp32 model >= 98%",
    "invariant": "batch invariance: a row's fp32 tokens do not depend on its batch",
    "seeded": "sampled rows with a seed give the same tokens alone and in a batch",
    "triton": "fp32 greedy tokens equal transformers' on the Triton kernels (interpreted)",
    "gguf": "loads from a GGUF file through transformers' GGUF reader, same greedy tokens",
    "encoder": "fp32 last hidden states / pooled head logits equal transformers'",
}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it loads
    module: str  # the module under batchrun.model.arch that defines it
    model: str  # the class in that module
    features: str  # what sets it apart, in a few words (for `batchrun models` and docs/models.md)
    model_types: tuple[str, ...]  # transformers' config.model_type of its checkpoints (GGUF configs carry only it)
    verified: tuple[str, ...]  # keys of VERIFIED_CHECKS


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), "llama", "LlamaForCausalLM",
           "RMSNorm, SwiGLU, GQA; rope scaling (llama3, yarn, linear, dynamic)",
           ("llama",), ("greedy", "logits", "bf16", "invariant", "seeded", "triton", "gguf")),
    Family("mistral", ("MistralForCausalLM",), "llama", "LlamaForCausalLM",
           "Llama with a sliding window on every layer",
           ("mistral",), ("greedy", "logits", "invariant", "seeded", "triton")),
    Family("qwen2", ("Qwen2ForCausalLM",), "llama", "LlamaForCausalLM",
           "Llama with q/k/v bias (Qwen2, Qwen2.5)", ("qwen2",), ("greedy", "logits")),
    Family("qwen3", ("Qwen3ForCausalLM",), "llama", "LlamaForCausalLM",
           "Llama with per-head q/k RMSNorm, explicit head_dim", ("qwen3",), ("greedy", "logits")),
    Family("gemma2", ("Gemma2ForCausalLM",), "gemma", "Gemma2ForCausalLM",
           "sandwich norms, GeGLU, alternating sliding/global layers, attention and final logit soft-capping",
           ("gemma2",), ("greedy", "logits", "bf16", "invariant", "seeded", "triton", "gguf")),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma", "Gemma3ForCausalLM",
           "Gemma 2's layer with q/k norms, sliding/global layers from layer_types, a local rope base",
           ("gemma3_text",), ("greedy", "logits", "bf16", "invariant", "seeded", "triton", "gguf")),
    Family("phi3", ("Phi3ForCausalLM",), "phi3", "Phi3ForCausalLM",
           "Phi-3 / Phi-4: fused qkv and gate_up, partial rotary, LongRoPE, sliding window",
           ("phi3",), ("greedy", "logits", "bf16", "invariant", "seeded", "triton", "gguf")),
    Family("olmo2", ("Olmo2ForCausalLM",), "olmo2", "Olmo2ForCausalLM",
           "norms after attention and MLP, q/k RMSNorm over the whole projection", ("olmo2",),
           ("greedy", "logits", "bf16", "invariant", "seeded", "triton")),
    Family("granite", ("GraniteForCausalLM",), "granite", "GraniteForCausalLM",
           "Llama with embedding, attention, residual and logit multipliers", ("granite",),
           ("greedy", "logits", "bf16", "invariant", "seeded", "triton")),
    Family("mixtral", ("MixtralForCausalLM",), "mixtral", "MixtralForCausalLM",
           "mixture of experts (top-k, renormalised), Mistral's attention", ("mixtral",),
           ("greedy", "logits", "bf16", "invariant", "seeded", "triton")),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), "qwen_moe", "Qwen2MoeForCausalLM",
           "mixture of experts with a gated shared expert, top-k normalised or not, dense layers between",
           ("qwen2_moe",), ("greedy", "logits", "bf16", "invariant", "seeded", "triton", "gguf")),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen_moe", "Qwen3MoeForCausalLM",
           "mixture of experts, Qwen3's attention (q/k norms)", ("qwen3_moe",),
           ("greedy", "logits", "bf16", "invariant", "seeded", "triton", "gguf")),
    # encoders (embed / classify / score; model/runner/encoder_runner.py): they do not generate
    Family("bert", ("BertModel", "BertForSequenceClassification"), "bert", "BertEncoder",
           "encoder: absolute positions, post-LayerNorm, GELU MLP; pooler + classifier head", ("bert",),
           ("encoder",)),
    Family("roberta", ("RobertaModel", "RobertaForSequenceClassification"), "bert", "RobertaEncoder",
           "BERT's encoder with positions from padding_idx + 1; dense-tanh-out_proj head", ("roberta",),
           ("encoder",)),
    Family("xlm_roberta", ("XLMRobertaModel", "XLMRobertaForSequenceClassification"), "bert", "RobertaEncoder",
           "RoBERTa's encoder (multilingual vocabulary)", ("xlm-roberta",), ("encoder",)),
    Family("modernbert", ("ModernBertModel", "ModernBertForSequenceClassification"), "modernbert",
           "ModernBertEncoder", "encoder: pre-norm, rotary with global and local bases, alternating global / local "
           "windowed attention, GeGLU; cls or mean pooled head", ("modernbert",), ("encoder",)),
)

POOLING_SUFFIXES = ("ForSequenceClassification", "Model")

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for f in FAMILIES for a in f.architectures)


def family_of(architecture: str) -> Family | None:
    """The family loading `architecture`; a decoder family's `*ForSequenceClassification` and bare `*Model`
    checkpoints (pooling models) load as its `*ForCausalLM` does."""
    family = next((f for f in FAMILIES if architecture in f.architectures), None)
    if family is None:
        for suffix in POOLING_SUFFIXES:
            if architecture.endswith(suffix):
                causal = architecture.removesuffix(suffix) + "ForCausalLM"
                return next((f for f in FAMILIES if causal in f.architectures), None)
    return family


def architecture_of_model_type(model_type: str) -> str | None:
    """The architecture name of a config that carries only its model_type (a GGUF file's)."""
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    return family.architectures[0] if family else None


def families_verifying(check: str) -> list[str]:
    if check not in VERIFIED_CHECKS:
        raise KeyError(check)
    return [f.name for f in FAMILIES if check in f.verified]


def model_class(architecture: str):
    family = family_of(architecture)
    if family is None:
        raise KeyError(architecture)
    return getattr(importlib.import_module(f"batchrun.model.arch.{family.module}"), family.model)


def models_table() -> str:
    lines = []
    for f in FAMILIES:
        lines.append(f"{f.name}: {', '.join(f.architectures)}")
        lines.append(f"    {f.features}")
        lines.append(f"    verified: {', '.join(f.verified)}")
    lines.append("")
    lines.append("verified means (tests/test_families.py on tiny random checkpoints, tests/test_families_gguf.py):")
    lines += [f"    {name}: {meaning}" for name, meaning in VERIFIED_CHECKS.items()]
    return "\n".join(lines)
