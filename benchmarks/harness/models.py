"""Random-weight checkpoints at real models' shapes, for rows where the weights set the pace: made once into
$BATCHRUN_CACHE/bench-models/NAME (nothing is downloaded; the tokenizer is the built-in models' small BPE one, so
prompts are token ids from its range and the text is meaningless: random text with EOS ignored).

A checkpoint is written a shard at a time, each tensor in row chunks (write_checkpoint), so making one never holds
the model in memory: an 8B-class model is made on a machine that can only just run it."""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchrun.paths import cache_dir

log = logging.getLogger(__name__)

GIB = 2**30
SHARD_BYTES = 2 * GIB
INIT_STD = 0.02

# Llama shapes: layers, widths, heads, vocabulary and rope as the real models' config.json give them (the weights are
# random).
SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B: 1.24B parameters, 2.5 GB in bf16, tied embeddings
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3.1-8B: 8.03B parameters, 15.0 GiB in bf16
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
}


def bench_dir() -> Path:
    """$BATCHRUN_CACHE/bench-models: where every bench checkpoint is made."""
    return cache_dir() / "bench-models"


def made_once(name: str, marker: str, make: Callable[[Path], Any]) -> Path:
    """bench_dir() / NAME, made by `make(folder)` on first use (a temp folder, then rename)."""
    path = bench_dir() / name
    if (path / marker).is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("making %s in %s (once)", name, path)
    make(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def bench_checkpoint(name: str) -> Path:
    """The checkpoint folder of SHAPES[name] in bf16, made on first use (write_checkpoint)."""
    return made_once(name, "config.json", lambda tmp: write_checkpoint(tmp, SHAPES[name]))


def tensors(shape: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama checkpoint of this shape, in Hugging Face's names and order."""
    h, inter, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim", h // heads)
    q, kv = heads * head_dim, shape["num_key_value_heads"] * head_dim
    out = [("model.embed_tokens.weight", (shape["vocab_size"], h))]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not shape.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (shape["vocab_size"], h)))
    return out


def checkpoint_bytes(name: str) -> int:
    """The bf16 weights' bytes of SHAPES[name]."""
    return sum(2 * math.prod(dims) for _, dims in tensors(SHAPES[name]))


def bytes_to_make(name: str) -> int:
    """The disk bench_checkpoint(name) still needs: 0 when it is made (or not one of SHAPES), else its weights' bytes
    and 1 GiB for the rest."""
    if name not in SHAPES or (bench_dir() / name / "config.json").is_file():
        return 0
    return checkpoint_bytes(name) + GIB


def write_checkpoint(folder: Path, shape: dict[str, Any], seed: int = 0) -> Path:
    """A Llama checkpoint of `shape` with random bf16 weights in `folder` (config, tokenizer, safetensors shards
    of about SHARD_BYTES and their index; matrices N(0, INIT_STD), norms ones), written a shard at a time. Kept when
    it is already there."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from batchrun.model.weights.builtin import train_tokenizer

    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    config = transformers.LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      torch_dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensors(shape):
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for name, dims in names:
            if len(dims) == 1:
                t = torch.ones(dims, dtype=torch.bfloat16)
            else:  # row chunks: never the whole tensor in fp32
                t = torch.empty(dims, dtype=torch.bfloat16)
                step = max(1, (64 * 2**20) // (4 * dims[1]))
                for r in range(0, dims[0], step):
                    t[r : r + step] = torch.randn(min(step, dims[0] - r), dims[1], generator=gen) * INIT_STD
            out[name] = t
            weight_map[name] = file
            total += t.numel() * 2
        save_file(out, str(folder / file), metadata={"format": "pt"})
        del out
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
