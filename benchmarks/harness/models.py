"""Random-weight checkpoints at real models' shapes, for rows where the weights set the pace: made once into
$BATCHRUN_CACHE/bench-models/NAME (nothing is downloaded; the tokenizer is the built-in models' small BPE one, so
prompts are token ids from its range and the text is meaningless: random text with EOS ignored)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from batchrun.paths import cache_dir

log = logging.getLogger(__name__)

# Llama-3.2-1B's shape (its config.json): 1.24B parameters, 2.5 GB in bf16, tied embeddings, llama3 rope scaling.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def bench_checkpoint(name: str) -> Path:
    """The checkpoint folder of SHAPES[name] in bf16, made on first use (a minute and a few GB of memory once)."""
    import torch

    from batchrun.model.weights.builtin import make_checkpoint

    path = cache_dir() / "bench-models" / name
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("making the random-weight checkpoint %s in %s (once)", name, path)
    make_checkpoint(tmp, "llama", dtype=torch.bfloat16, **SHAPES[name])
    tmp.rename(path)
    return path
