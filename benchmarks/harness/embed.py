"""The embedding workload: texts of natural lengths built from the repository's text, and how every system's worker
times embedding them.

The texts are built without network, in a fixed order and from a fixed seed, from the passages the loglikelihood
rows read (benchmarks/harness/loglik.py: the calibration passages, the benchmark's passage, the prose of README.md
and docs/*.md) and the chat workload's questions (benchmarks/harness/chat.py). Each text gets a length drawn
log-normal and clipped to a range, in the BERT tokenizer's tokens ([CLS] and [SEP] included), and is made of spans
of consecutive sentences: it starts at a sentence, runs on for a drawn number of sentences, jumps to a sentence of
any passage, and so on, until it reaches its length; then its last words are cut to the length. Texts start at
sentences in a seeded shuffle; once every sentence has started a text, later texts start a few words into their
sentence. No two texts start with the same DISTINCT_WORDS words, so texts share no prefix (a prefix cache finds
nothing to reuse between them). The text changes when the docs do; `meta.fingerprint` names the exact texts a run
embedded.

Standard library only at import (the peers' workers in their own venvs time and report with `timed_embedding`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.clock import Clock, Result, best_of, rss_mb

ROOT = Path(__file__).resolve().parents[2]
CHAT = "benchmarks/harness/chat.py"
DISTINCT_WORDS = 8  # no two texts start with the same this many words
MAX_SPAN = 6  # a span runs on for 1..MAX_SPAN sentences before the text jumps elsewhere
SKIP_WORDS = 3  # each later pass over the start sentences starts this many words further into them
KEEP = 50  # the embeddings a worker returns: the first KEEP texts', to compare systems with
# Texts embedded before the timed part (first-call costs, lazy allocations, thread start-up fall outside it).
WARMUP_TEXTS = ("A short text to warm the engine up before the timed part.",
                "Every system embeds these two texts once, untimed, after its model loads.")


def text_sources(root: Path = ROOT) -> list[tuple[str, tuple[str, ...]]]:
    """(file, sentences) of every passage of the repository's text, then the chat questions as one more; in a
    fixed order."""
    from benchmarks.harness.chat import QUESTIONS
    from benchmarks.harness.loglik import passages

    return [(p.source, p.sentences) for p in passages(root)] + [(CHAT, tuple(QUESTIONS))]


@dataclass
class EmbedTexts:
    """The texts, each one's length in the BERT tokenizer's tokens (special tokens included), and how they were
    made."""

    name: str
    texts: list[str]
    tokens: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.texts)

    def summary(self) -> dict[str, Any]:
        t = sorted(self.tokens)
        return {"name": self.name, "texts": len(t), "tokens": sum(t), "tokens_min": t[0], "tokens_max": t[-1],
                "tokens_mean": sum(t) / len(t), "tokens_median": t[len(t) // 2], **self.meta}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EmbedTexts:
        return cls(d["name"], list(d["texts"]), list(d["tokens"]), dict(d.get("meta", {})))


def fingerprint(texts: Sequence[str]) -> str:
    """A short hash of the texts: equal fingerprints, the same work."""
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()[:12]


def _cut(text: str, count: Callable[[str], int], limit: int) -> tuple[str, int]:
    """The longest run of `text`'s first words whose count is at most `limit`, and its count."""
    n = count(text)
    if n <= limit:
        return text, n
    words = text.split()
    lo, hi = 1, len(words) - 1  # the answer: the largest w with count(words[:w]) <= limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= limit:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    return text, count(text)


def build_texts(count: Callable[[str], int], num_texts: int = 2000, seed: int = 0, median: float = 128.0,
                sigma: float = 0.8, length_range: tuple[int, int] = (16, 512), root: Path = ROOT,
                name: str = "embed") -> EmbedTexts:
    """num_texts texts (module docstring); `count(text)` is the text's length in tokens with the tokenizer's special
    tokens (the BERT tokenizer's). Each text's length is drawn log-normal (median, sigma) and clipped to
    length_range; a text is that long or, where its last word takes several tokens, a token or two shorter (never
    below the range's minimum). Texts are made one after another from one seeded generator, so the first n of a
    build are the texts a build of n gives."""
    sources = text_sources(root)
    sents = [(s, i) for s, (_, ss) in enumerate(sources) for i in range(len(ss))]
    rng = random.Random(seed)
    order = list(sents)
    rng.shuffle(order)
    lo, hi = length_range
    overhead = count("")
    sizes: dict[str, int] = {}

    def size(s: str) -> int:  # a piece's tokens without the special tokens
        if s not in sizes:
            sizes[s] = count(s) - overhead
        return sizes[s]

    texts: list[str] = []
    lengths: list[int] = []
    firsts: set[tuple[str, ...]] = set()
    starts: dict[str, int] = {}
    longest = max(len(s.split()) for _, ss in sources for s in ss)
    k = 0
    while len(texts) < num_texts:
        passes, (src, i) = k // len(order), order[k % len(order)]
        k += 1
        if SKIP_WORDS * passes >= longest:
            raise ValueError(f"the repository's text gives only {len(texts)} distinct texts")
        words = sources[src][1][i].split()[SKIP_WORDS * passes:]
        if len(words) < 4:
            continue
        key = tuple(w.lower() for w in words[:DISTINCT_WORDS])
        if key in firsts:
            continue
        want = min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))
        pieces = [" ".join(words)]
        have = overhead + size(pieces[0])
        left = rng.randint(1, MAX_SPAN) - 1  # sentences still to come in this span
        at = (src, i)
        while have < want:
            if left > 0 and at[1] + 1 < len(sources[at[0]][1]):
                at, left = (at[0], at[1] + 1), left - 1
            else:
                at, left = rng.choice(sents), rng.randint(1, MAX_SPAN) - 1
            pieces.append(sources[at[0]][1][at[1]])
            have += size(pieces[-1])
        text, n = _cut(" ".join(pieces), count, want)
        if n < lo:
            continue
        firsts.add(key)
        texts.append(text)
        lengths.append(n)
        starts[sources[src][0]] = starts.get(sources[src][0], 0) + 1
    by_source: dict[str, int] = {}
    for source, n in starts.items():
        key = "docs" if source.endswith(".md") else source
        by_source[key] = by_source.get(key, 0) + n
    meta = {"seed": seed, "median": median, "sigma": sigma, "length_range": [lo, hi], "starts": by_source,
            "fingerprint": fingerprint(texts)}
    return EmbedTexts(name, texts, lengths, meta)


# ---- timing, the same in every system's worker --------------------------------------------------------------


def timed_embedding(load: Callable[[], Any], embed: Callable[[Any, list[str]], Sequence[Sequence[float]]],
                    texts: list[str], threads: Callable[[], int], repeat: int = 1,
                    config: dict[str, Any] | None = None) -> Result:
    """Load the model (untimed), embed WARMUP_TEXTS (untimed), then time `embed(model, texts)` once: its wall time,
    the process's memory, and the first KEEP embeddings; `repeat` times on a fresh model each, keeping the fastest.
    `threads()` (read after the load) is the threads the system computes with."""
    runs = []
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        model = load()
        load_s, load_rss = time.perf_counter() - t, rss_mb()
        embed(model, list(WARMUP_TEXTS))
        with Clock(threads()) as clock:
            vecs = embed(model, texts)
        if len(vecs) != len(texts):
            raise RuntimeError(f"{len(vecs)} embeddings for {len(texts)} texts")
        runs.append({**clock.as_dict(), "items": len(texts), "dim": len(vecs[0]) if len(vecs) else 0,
                     "embeddings": [[float(x) for x in v] for v in vecs[:KEEP]], "load_s": load_s,
                     "load_rss_mb": load_rss, "config": config or {}})
        del model, vecs
        gc.collect()
    return best_of(runs)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else float("nan")
