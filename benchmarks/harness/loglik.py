"""The loglikelihood workload: four-choice items of natural text, scored the way an evaluation harness scores
multiple-choice tasks (each choice's summed log-probability after the context; the item's answer the best choice).

The items are built without network from the text this repository holds, in a fixed order and from a fixed seed:
the calibration passages (`batchrun/model/quant/data/calibration.json`), the benchmark's passage
(`benchmarks/micro/data/quant_text.txt`), and the prose of README.md and docs/*.md (code blocks, tables and headings
left out; a page is a passage). An item is a run of a passage's sentences as the context (its length drawn
log-normal, 50..300 tokens), the sentence that follows as the correct continuation, and three sentences of other
passages, of about the same length, as the distractors. No two items start at the same sentence or with the same
DISTINCT_PREFIX tokens, so items share no KV block: only an item's own choices share their context. The text changes
when the docs do; `meta.fingerprint` names the exact items a run scored.

Tokenized as lm-eval's harness does it: the context with the tokenizer's special tokens, each continuation (a space,
then the sentence) without; a request's prompt is their concatenation.

Standard library only at import (vLLM's worker reads the workload and scores with it in its own venv); building the
items loads the model's tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = "batchrun/model/quant/data/calibration.json"
PASSAGE = "benchmarks/micro/data/quant_text.txt"
# No two items' contexts start with the same this many tokens: batchrun's KV block in the plans
# (benchmarks/harness/plans.py: BLOCK_SIZE), so items share no block through the prefix cache.
DISTINCT_PREFIX = 8

# A sentence ends at . ! or ? after a word, a figure or a closing bracket or quote, before a capital or an opening
# bracket or quote ("e.g. the" and "1.5x" do not end one).
_SENTENCE_END = re.compile(r"(?<=[A-Za-z0-9)\]'\"][.!?])\s+(?=[A-Z(\"'])")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_HEADING = re.compile(r"^#+ .*$", re.M)
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_LIST_ITEM = re.compile(r"\s*(?:[-*]|\d+\.)\s+(.*)")


@dataclass(frozen=True)
class Passage:
    source: str  # the file, relative to the repository
    sentences: tuple[str, ...]


def _clean(text: str) -> str:
    """Markdown to plain text: links to their words, no code or emphasis marks, one space between words."""
    text = _LINK.sub(r"\1", text).replace("`", "").replace("**", "").replace("\\*", "*")
    return re.sub(r"\s+", " ", text).strip()


def sentences(text: str, min_words: int = 4) -> list[str]:
    return [s for s in _SENTENCE_END.split(_clean(text)) if len(s.split()) >= min_words]


def markdown_passage(source: str, text: str) -> Passage:
    """A Markdown page's prose as one passage: its paragraphs and list items, in order (code blocks, tables,
    quotes, HTML and headings left out)."""
    sents: list[str] = []
    for section in _HEADING.split(_FENCE.sub("\n\n", text)):
        units: list[str] = []
        for block in re.split(r"\n\s*\n", section):
            lines = block.splitlines()
            if not lines or any(ln.lstrip().startswith(("|", "<", "!", ">")) for ln in lines):
                continue
            current: list[str] = []
            for ln in lines:
                m = _LIST_ITEM.match(ln)
                if m and current:
                    units.append(" ".join(current))
                    current = []
                current.append(m.group(1) if m else ln.strip())
            if current:
                units.append(" ".join(current))
        sents += [s for u in units for s in sentences(u)]
    return Passage(source, tuple(sents))


def passages(root: Path = ROOT) -> list[Passage]:
    """Every passage of the repository's text, in a fixed order."""
    out = [Passage(CALIBRATION, tuple(sentences(x["answer"])))
           for x in json.loads((root / CALIBRATION).read_text())]
    out.append(Passage(PASSAGE, tuple(sentences((root / PASSAGE).read_text()))))
    for page in sorted([root / "README.md", *(root / "docs").glob("*.md")]):
        out.append(markdown_passage(page.relative_to(root).as_posix(), page.read_text()))
    return [p for p in out if len(p.sentences) >= 2]


# ---- the workload ---------------------------------------------------------------------------------------


@dataclass
class LoglikWorkload:
    """Items {"context": ids, "choices": [ids, ...], "gold": index of the true continuation, "source": file}."""

    name: str
    items: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.items)

    def requests(self) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) for every item's every choice, item by item: the order of a job's rows, and of
        every system's scores."""
        return [(it["context"], c) for it in self.items for c in it["choices"]]

    @property
    def num_choices(self) -> int:
        return len(self.items[0]["choices"]) if self.items else 0

    @property
    def max_len(self) -> int:
        return max(len(c) + len(x) for c, x in self.requests())

    def summary(self) -> dict[str, Any]:
        ctx = [len(it["context"]) for it in self.items]
        cont = [len(c) for it in self.items for c in it["choices"]]
        return {"name": self.name, "items": len(self), "choices": self.num_choices, "requests": len(cont),
                "context_tokens": sum(ctx), "context_len_min": min(ctx), "context_len_mean": sum(ctx) / len(ctx),
                "context_len_max": max(ctx), "scored_tokens": sum(cont), "continuation_len_min": min(cont),
                "continuation_len_mean": sum(cont) / len(cont), "continuation_len_max": max(cont),
                "request_tokens": sum(len(c) + len(x) for c, x in self.requests()), **self.meta}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoglikWorkload:
        return cls(d["name"], list(d["items"]), dict(d.get("meta", {})))


def fingerprint(items: Sequence[dict[str, Any]]) -> str:
    """A short hash of the items' token ids and answers: equal fingerprints, the same work."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it["context"], it["choices"], it["gold"]]).encode())
    return h.hexdigest()[:12]


def build_items(model_path: str | Path, num_items: int = 500, seed: int = 0, context_median: float = 120.0,
                context_sigma: float = 0.6, context_range: tuple[int, int] = (50, 300),
                continuation_range: tuple[int, int] = (6, 64), num_choices: int = 4, root: Path = ROOT,
                name: str = "loglik") -> LoglikWorkload:
    """Up to num_items items from the repository's passages (fewer only if the text runs out), with the model's
    tokenizer. Each candidate start sentence (taken in a seeded shuffle) gets a context length drawn log-normal
    (median, sigma) and clipped to context_range; its context is the fewest sentences from the start that reach it
    (or those up to the passage's last sentence, if they reach the range's minimum), its answer the next sentence;
    distractors are sentences of other passages whose token count is within 2/3..3/2 of the answer's (the nearest in
    length when fewer are), all within continuation_range."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    ps = passages(root)
    cont_ids = [[list(ids) for ids in tok([" " + s for s in p.sentences], add_special_tokens=False)["input_ids"]]
                for p in ps]
    lo_c, hi_c = continuation_range
    pool = [(len(ids), pi, p.sentences[si], ids) for pi, (p, cs) in enumerate(zip(ps, cont_ids))
            for si, ids in enumerate(cs) if lo_c <= len(ids) <= hi_c]
    rng = random.Random(seed)
    starts = [(pi, a) for pi, p in enumerate(ps) for a in range(len(p.sentences) - 1)]
    rng.shuffle(starts)
    lo, hi = context_range
    items: list[dict[str, Any]] = []
    firsts: set[str] = set()
    prefixes: set[tuple[int, ...]] = set()
    for pi, a in starts:
        if len(items) == num_items:
            break
        p, cs = ps[pi], cont_ids[pi]
        if p.sentences[a] in firsts:
            continue
        want = min(hi, max(lo, round(rng.lognormvariate(math.log(context_median), context_sigma))))
        b, have = a, 0
        while b < len(p.sentences) - 1 and have < want:
            have += len(cs[b])
            b += 1
        answer = cs[b]
        if have < lo or not lo_c <= len(answer) <= hi_c:  # short of `want` only where the passage ends
            continue
        context = list(tok(" ".join(p.sentences[a:b]), add_special_tokens=True)["input_ids"])
        if not lo <= len(context) <= hi or tuple(context[:DISTINCT_PREFIX]) in prefixes:
            continue
        own = set(p.sentences)
        near = [x for x in pool if x[1] != pi and x[2] not in own]  # nor a sentence this passage has
        fits = [x for x in near if 2 * len(answer) <= 3 * x[0] and 2 * x[0] <= 3 * len(answer)]
        if len(fits) < num_choices - 1:
            fits = sorted(near, key=lambda x: abs(x[0] - len(answer)))[: 4 * num_choices]
        choices = [answer] + [x[3] for x in rng.sample(fits, num_choices - 1)]
        order = list(range(num_choices))
        rng.shuffle(order)
        firsts.add(p.sentences[a])
        prefixes.add(tuple(context[:DISTINCT_PREFIX]))
        items.append({"context": context, "choices": [choices[i] for i in order], "gold": order.index(0),
                      "source": p.source})
    sources: dict[str, int] = {}
    for it in items:
        key = "docs" if it["source"].endswith(".md") else it["source"]
        sources[key] = sources.get(key, 0) + 1
    meta = {"seed": seed, "sources": sources, "fingerprint": fingerprint(items), "context_median": context_median,
            "context_range": list(context_range), "continuation_range": list(continuation_range)}
    return LoglikWorkload(name, items, meta)


# ---- scoring, as the clients do it ------------------------------------------------------------------------


def lm_eval_order(requests: Sequence[tuple[list[int], list[int]]]) -> list[int]:
    """The order lm-eval's harness sends requests in (its Collator): longest context + continuation first, ties by
    the tokens."""
    return sorted(range(len(requests)), key=lambda i: (-len(requests[i][0]) - len(requests[i][1]),
                                                       tuple(requests[i][0] + requests[i][1])))


def score_prompt_logprobs(prompt_logprobs: Sequence[Any], prompt_ids: Sequence[int], context_len: int,
                          by_rank: bool = False) -> tuple[float, bool]:
    """A continuation's (summed log-probability, is greedy) from a RequestOutput's prompt_logprobs (vLLM's shape,
    batchrun's or vLLM's Logprob objects) over prompt_ids, the continuation starting at context_len. Greedy: each
    continuation token has rank 1 (by_rank: the entry holds only the token, prompt_logprobs=0), else each is the most
    likely of its entry as lm-eval's vLLM backend reads it (prompt_logprobs=1)."""
    total, greedy = 0.0, True
    for pos in range(context_len, len(prompt_ids)):
        entry, token = prompt_logprobs[pos], prompt_ids[pos]
        total += entry[token].logprob
        if greedy:
            greedy = entry[token].rank == 1 if by_rank else max(entry, key=lambda t: entry[t].logprob) == token
    return total, greedy


def answers(scores: Iterable[Sequence[Any]], num_choices: int) -> list[int]:
    """Each item's answer: the choice with the highest summed log-probability (the first on a tie)."""
    flat = [s[0] for s in scores]
    return [max(range(num_choices), key=lambda c: flat[i + c]) for i in range(0, len(flat), num_choices)]
