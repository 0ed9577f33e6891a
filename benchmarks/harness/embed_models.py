"""Random-weight embedding checkpoints for the embedding rows, as sentence-transformers folders: made once into
$BATCHRUN_CACHE/bench-models/NAME (nothing is downloaded), from torch.manual_seed(0).

Each folder is what a sentence-transformers model on the Hub looks like: the transformer's config, weights and
tokenizer at its root, modules.json (Transformer, Pooling, Normalize), 1_Pooling/config.json and
sentence_bert_config.json. vLLM and sentence-transformers read the pooling and the normalisation from those files,
as batchrun does.

- A BERT-base encoder (BertModel), mean pooling. Its tokenizer is a BERT WordPiece tokenizer (lower case, [CLS] ...
  [SEP]) trained here on the repository's text (benchmarks/harness/embed.py: text_sources) and the built-in models'
  synthetic corpus; the model's vocabulary (30522) covers its ids.
- A Qwen3-Embedding-0.6B-shaped decoder, last-token pooling: its weights are a Qwen3Model's (names without
  "model."), its config says Qwen3ForCausalLM with tied embeddings, as the real checkpoint's do. Its tokenizer is the
  built-in models' small BPE one (batchrun.model.weights.builtin.train_tokenizer), which appends <|endoftext|> to
  every text and pads on the left, as Qwen3-Embedding's does, so the last token pooled is the end of text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.models import made_once

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4: [PAD] is BertConfig's pad_token_id 0
BERT_TOKENIZER = "bert-wordpiece-tokenizer"  # its folder under bench-models


@dataclass(frozen=True)
class EmbedShape:
    """One embedding checkpoint: its family ("bert" or "qwen3"), the pooling sentence-transformers applies, its
    config overrides, the dtype its weights are saved in, and the longest input it takes."""

    family: str
    pooling: str  # a 1_Pooling/config.json mode: "mean_tokens" or "lasttoken"
    config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    max_seq_length: int = 512


EMBED_SHAPES: dict[str, EmbedShape] = {
    # bert-base-uncased's shape: 110M parameters, 512 positions; weights in fp32 as BERT checkpoints keep them
    "bert-base-st": EmbedShape("bert", "mean_tokens", dict(
        vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        max_position_embeddings=512, type_vocab_size=2)),
    # Qwen3-Embedding-0.6B's shape: 0.6B parameters, tied embeddings, weights in bf16 as the real checkpoint's
    "qwen3-embedding-0.6b": EmbedShape("qwen3", "lasttoken", dict(
        vocab_size=151669, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True), dtype="bfloat16", max_seq_length=32768),
    # the quick mode's stand-ins: the same families and files at toy sizes (head_dim 64, which every peer's CPU
    # attention takes)
    "bert-tiny-st": EmbedShape("bert", "mean_tokens", dict(
        vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
        max_position_embeddings=512, type_vocab_size=2)),
    "qwen3-embedding-tiny": EmbedShape("qwen3", "lasttoken", dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        intermediate_size=256, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True), max_seq_length=4096),
}


def embed_checkpoint(name: str) -> Path:
    """The sentence-transformers folder of EMBED_SHAPES[name], made on first use."""
    return made_once(name, "modules.json", lambda tmp: make_embed_checkpoint(tmp, EMBED_SHAPES[name]))


def bert_tokenizer_path() -> Path:
    """The BERT tokenizer's folder (bert_tokenizer, saved once): the BERT checkpoints' tokenizer, and what the
    embedding texts' lengths are counted with."""
    return made_once(BERT_TOKENIZER, "tokenizer.json", lambda tmp: bert_tokenizer().save_pretrained(tmp))


def make_embed_checkpoint(path: Path, shape: EmbedShape, seed: int = 0) -> Path:
    """Write `shape`'s random-weight model, its tokenizer and its sentence-transformers files into `path`."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    if shape.family == "bert":
        tok = transformers.AutoTokenizer.from_pretrained(bert_tokenizer_path())
        config = transformers.BertConfig(pad_token_id=tok.pad_token_id, **shape.config)
        model_cls, architecture = transformers.BertModel, "BertModel"
    elif shape.family == "qwen3":
        tok = qwen3_tokenizer()
        cfg = {"vocab_size": (len(tok) + 63) // 64 * 64, **shape.config}
        config = transformers.Qwen3Config(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id, sliding_window=None,
                                          use_sliding_window=False, **cfg)
        model_cls, architecture = transformers.Qwen3Model, "Qwen3ForCausalLM"
    else:
        raise ValueError(f"unknown embedding family {shape.family!r}")
    if len(tok) > config.vocab_size:
        raise ValueError(f"the tokenizer's {len(tok)} ids do not fit the vocabulary of {config.vocab_size}")
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, shape.dtype)).eval()
    model.save_pretrained(path)
    # save_pretrained names the class saved (Qwen3Model); the config keeps the architecture the real checkpoint names
    cfg_file = path / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "architectures": [architecture]},
                                   indent=2))
    tok.save_pretrained(path)
    tok_config = path / "tokenizer_config.json"
    extra = {"model_max_length": shape.max_seq_length}
    if shape.family == "qwen3":
        extra["padding_side"] = "left"
    tok_config.write_text(json.dumps({**json.loads(tok_config.read_text()), **extra}, indent=2))
    write_st_files(path, shape.pooling, config.hidden_size, shape.max_seq_length)
    return path


def write_st_files(path: Path, pooling: str, dim: int, max_seq_length: int) -> None:
    """sentence-transformers' files: the Transformer at the root, then Pooling (`pooling`) and Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    if pooling not in modes:
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {modes}")
    pool = {"word_embedding_dimension": dim, **{f"pooling_mode_{m}": m == pooling for m in modes},
            "include_prompt": True}
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                 "do_lower_case": False}, indent=2))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2))


def bert_tokenizer(vocab_size: int = 30522) -> Any:
    """A BERT WordPiece tokenizer (lower case, [CLS] text [SEP]) trained on the repository's text and the built-in
    models' synthetic corpus: the same vocabulary on every machine for the same text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer

    from batchrun.model.weights.builtin import synthetic_corpus
    from benchmarks.harness.embed import text_sources

    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=True)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS), show_progress=False)
    wp.train_from_iterator([s for _, sents in text_sources() for s in sents] + synthetic_corpus(), trainer=trainer)
    return BertTokenizer(vocab=wp.get_vocab(), do_lower_case=True)


def qwen3_tokenizer() -> Any:
    """The built-in models' BPE tokenizer, ending every text with <|endoftext|> as Qwen3-Embedding's tokenizer does."""
    from tokenizers import processors

    from batchrun.model.weights.builtin import train_tokenizer

    tok = train_tokenizer()
    eos = tok.eos_token
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=[(eos, tok.eos_token_id)])
    return tok
