"""Workloads (requests with exact output lengths) and the model FLOPs they cost.

Prompts are token ids, not text, so every system sees exactly the same input and no tokenizer round trip can
make them differ. Lengths follow log-normal distributions like ShareGPT's (a long right tail), clipped to a
range, from a fixed seed: the same workload on every machine and every run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Ids 0..2 are the built-in tokenizer's special tokens (end of text, chat markers); prompts avoid them.
FIRST_ORDINARY_ID = 3


@dataclass(frozen=True)
class LengthDist:
    """A log-normal length distribution (median, sigma of the log) clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        x = rng.lognormal(mean=math.log(self.median), sigma=self.sigma, size=n)
        return [int(v) for v in np.clip(np.rint(x), self.lo, self.hi)]


@dataclass(frozen=True)
class Decoding:
    """How every request of a workload decodes, the same for every system under test. Request i samples with seed
    + i. stop_at_eos False: exactly output_lens[i] tokens (EOS ignored, the random-text view); True: at most that
    many, ended by any of eos_token_ids (chat replies), which is not counted as generated."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    n: int = 1
    stop_at_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        how = "greedy" if self.temperature == 0 else f"sampled (T {self.temperature:g}" + (
            f", top_p {self.top_p:g}" if self.top_p < 1 else "") + (f", top_k {self.top_k}" if self.top_k else "") + ")"
        return how + (f", n = {self.n}" if self.n > 1 else "") + (", to EOS" if self.stop_at_eos else ", EOS ignored")


@dataclass
class Workload:
    """Requests as (prompt token ids, the tokens to generate: exactly, or at most with decoding.stop_at_eos)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)
    decoding: Decoding = field(default_factory=Decoding)

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError("a workload needs one output length per prompt")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

    def head(self, n: int, name: str | None = None) -> Workload:
        return Workload(name or f"{self.name}[:{n}]", self.prompts[:n], self.output_lens[:n], dict(self.meta),
                        self.decoding)

    def blocks_needed(self, block_size: int) -> int:
        """KV blocks to hold every request at its final length at once, with nothing shared: the demand."""
        return sum(-(-(len(p) + o) // block_size) for p, o in zip(self.prompts, self.output_lens))

    def summary(self) -> dict[str, Any]:
        p = [len(x) for x in self.prompts]
        return {"name": self.name, "requests": len(self), "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "prompt_len_min": min(p), "prompt_len_mean": sum(p) / len(p),
                "prompt_len_max": max(p), "output_len_min": min(self.output_lens),
                "output_len_mean": self.output_tokens / len(self), "output_len_max": max(self.output_lens),
                "decoding": self.decoding.label, **self.meta}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Workload:
        dec = d.get("decoding") or {}
        dec = Decoding(**{**dec, "eos_token_ids": tuple(dec.get("eos_token_ids", ()))})
        return cls(d["name"], [list(p) for p in d["prompts"]], list(d["output_lens"]), dict(d.get("meta", {})), dec)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json()))


def sharegpt_like(num_requests: int, vocab_size: int, seed: int, prompt: LengthDist, output: LengthDist,
                  name: str = "sharegpt-like") -> Workload:
    """Random prompts with ShareGPT-like log-normal lengths; token ids from the tokenizer's ordinary range."""
    rng = np.random.default_rng(seed)
    p_lens = prompt.sample(rng, num_requests)
    o_lens = output.sample(rng, num_requests)
    prompts = [rng.integers(FIRST_ORDINARY_ID, vocab_size, size=n).tolist() for n in p_lens]
    return Workload(name, prompts, o_lens, {"seed": seed, "prompt_dist": asdict(prompt),
                                             "output_dist": asdict(output)})


def shared_prefix(num_requests: int, prefix_len: int, vocab_size: int, seed: int, suffix: LengthDist,
                  output: LengthDist, name: str = "shared-prefix") -> Workload:
    """Requests that all start with the same `prefix_len`-token system prompt, then a unique suffix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(FIRST_ORDINARY_ID, vocab_size, size=prefix_len).tolist()
    s_lens = suffix.sample(rng, num_requests)
    o_lens = output.sample(rng, num_requests)
    prompts = [prefix + rng.integers(FIRST_ORDINARY_ID, vocab_size, size=n).tolist() for n in s_lens]
    return Workload(name, prompts, o_lens, {"seed": seed, "shared_prefix_len": prefix_len,
                                             "suffix_dist": asdict(suffix), "output_dist": asdict(output)})


# ---- the model's shape and FLOPs ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count and the KV size need from a Llama-family config."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, cfg: dict[str, Any], dtype_bytes: int = 4) -> ModelShape:
        """A mixture-of-experts config counts the MLP weights a token goes through: its top-k experts' (and a
        shared expert's), as an equivalent intermediate size (the router's few weights are left out)."""
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        intermediate = cfg["intermediate_size"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if experts:
            per_expert = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            intermediate = per_expert * cfg["num_experts_per_tok"] + (cfg.get("shared_expert_intermediate_size") or 0)
        return cls(cfg["num_hidden_layers"], cfg["hidden_size"], intermediate, heads,
                   cfg.get("num_key_value_heads") or heads, head_dim, cfg["vocab_size"], dtype_bytes)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token multiplies through per decoder layer: q, k, v, o and the gated MLP."""
        attn = self.hidden * self.num_heads * self.head_dim * 2 + self.hidden * self.num_kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return attn + mlp

    @property
    def body_params(self) -> int:
        return self.num_layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def model_flops(shape: ModelShape, workload: Workload) -> dict[str, float]:
    """The useful FLOPs of a workload: what any correct engine must compute, whatever it wastes on top.

    Per request with prompt length p and o generated tokens, the model runs p + o - 1 token positions (the last
    generated token is never fed back) and needs logits at o of them (the last prompt position and each fed-back
    token). With a multiply-add counted as 2 FLOPs:

        matmul    = 2 * body_params * (p + o - 1) + 2 * lm_head_params * o
        attention = sum over positions t = 0 .. p + o - 2 of 4 * layers * heads * head_dim * (t + 1)
                  = 4 * layers * heads * head_dim * (n (n + 1) / 2),  n = p + o - 1

    body_params are the decoder layers' matmul weights (q, k, v, o, gate, up, down); the embedding lookup is not
    a matmul and norms, rotary and activations are left out (well under 1%). Attention is QK^T plus AV over the
    causal context only. Padding, logits at prompt positions and recomputation after preemption are waste, so
    they are not counted: a system that does them shows a lower utilisation.
    """
    body = lm = attn = 0.0
    per_ctx = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim
    for prompt, o in zip(workload.prompts, workload.output_lens):
        n = len(prompt) + o - 1
        body += 2.0 * shape.body_params * n
        lm += 2.0 * shape.lm_head_params * o
        attn += per_ctx * n * (n + 1) / 2
    return {"matmul_flops": body + lm, "attention_flops": attn, "total_flops": body + lm + attn,
            "body_params": shape.body_params, "lm_head_params": shape.lm_head_params}


def contiguous_preallocation(kv_bytes: int, shape: ModelShape, max_model_len: int,
                             workload: Workload) -> dict[str, float]:
    """The paper's comparison: the same KV bytes preallocated contiguously, max_model_len slots per sequence.

    `max_seqs` is how many sequences such a cache holds at once. `slot_utilisation` is the share of a sequence's
    reserved slots that hold live tokens, averaged over every decode step of every request (a request with
    prompt p holds p + t tokens at its t-th step); it is the best case, with no fragmentation between slots.
    """
    per_seq = max_model_len * shape.kv_bytes_per_token
    live = steps = 0
    for prompt, o in zip(workload.prompts, workload.output_lens):
        p = len(prompt)
        live += o * p + o * (o + 1) / 2
        steps += o
    return {"max_model_len": max_model_len, "max_seqs": kv_bytes // per_seq,
            "slot_utilisation": live / (steps * max_model_len) if steps else 0.0}
