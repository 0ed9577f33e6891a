"""GGUF for the families transformers' GGUF reader takes (Gemma 2, Gemma 3, Phi-3, Qwen2-MoE, Qwen3-MoE; not
OLMo 2, Granite or Mixtral, whose GGUF files it does not read): a tiny random checkpoint is written as a GGUF file
the way llama.cpp's converter lays it out (tensor names from gguf's own name map, Gemma's norms stored as 1 + w,
the experts stacked per projection, a byte-level BPE tokenizer), then batchrun loads the file and must give the
greedy tokens it gives for the checkpoint itself (tests/test_families.py holds those to transformers').

The checkpoints keep every setting the GGUF metadata does not carry at transformers' default (a GGUF config is
built from the metadata and the defaults), and set the ones it carries away from them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.model.arch.registry import families_verifying

# family -> (make_ckpt arch, overrides of conftest.ARCH_SPECS, GGUF architecture name). An eps that float32 holds
# exactly (GGUF stores it in float32); the settings GGUF does not carry back at transformers' defaults.
EPS = 2.0**-20
GGUF_CHECKPOINTS = {
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=24, rms_norm_eps=EPS, query_pre_attn_scalar=256,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0), "gemma2"),
    "gemma3": ("gemma3", dict(num_hidden_layers=2, sliding_window=20, rms_norm_eps=EPS, query_pre_attn_scalar=256,
                              layer_types=None, rope_parameters=None), "gemma3"),
    "phi3": ("phi3", dict(rms_norm_eps=EPS, sliding_window=None, rope_parameters=None), "phi3"),
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=2, mlp_only_layers=None, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                                    rms_norm_eps=EPS), "qwen2moe"),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, moe_intermediate_size=768, rms_norm_eps=EPS), "qwen3moe"),
}
FAMILIES = [f for f in families_verifying("gguf") if f != "llama"]  # llama: test_gguf.py, on SmolLM2's file


def write_gguf(hf_dir, file, arch: str, tokenizer) -> None:
    """A GGUF file of the checkpoint in hf_dir, in fp32, as llama.cpp's converter would name and shape it."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = hf.config
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=cfg.to_dict())
    names = get_gguf_hf_weights_map(hf, processor)  # GGUF name -> transformers' name
    state = hf.state_dict()
    w = gguf.GGUFWriter(str(file), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(params["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in tokenizer.all_special_tokens else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    inter = getattr(cfg, "moe_intermediate_size", None)
    for name, hf_name in names.items():
        if name.startswith("output.") and cfg.tie_word_embeddings:
            continue
        t = state[hf_name].numpy()
        if name.endswith("ffn_gate_exps"):
            t = t[:, :inter]  # the stacked gate|up, split back into llama.cpp's two tensors
        elif name.endswith("ffn_up_exps"):
            t = t[:, inter:]
        elif "ffn_gate_inp_shexp" in name:
            t = t.reshape(-1)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(name if name.endswith((".weight", ".bias")) else f"{name}.weight",
                     np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_gives_the_checkpoints_greedy_tokens(make_ckpt, tokenizer, tmp_path, family):
    pytest.importorskip("gguf")
    arch, overrides, gguf_arch = GGUF_CHECKPOINTS[family]
    path = make_ckpt(arch, **overrides)
    file = tmp_path / f"tiny-{family}.gguf"
    write_gguf(path, file, gguf_arch, tokenizer)
    prompts = [[5, 9, 200, 31], list(range(40, 80)), [7] * 3]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    from_gguf = LLM(str(file), dtype="float32", device="cpu", num_kv_blocks=32)
    from_folder = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=32)
    assert type(from_gguf.engine.runner.model) is type(from_folder.engine.runner.model)
    theirs, ours = from_gguf.config.to_dict(), from_folder.config.to_dict()
    differ = {k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)}
    assert differ <= {"_name_or_path", "_model_name_or_path", "dtype", "initializer_range"}, differ

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                               use_tqdm=False)]

    assert tokens(from_gguf) == tokens(from_folder)
