"""OpenAI's chat and completions `logprobs` objects, from CompletionOutput.logprobs' per-token {token id: logprob}.

A token's text is what it decodes to alone (part of a multi-byte character: U+FFFD, as other OpenAI-compatible
servers). The writer has no engine: it loads the tokenizer itself, once per process, when a row asks for logprobs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

Decode = Callable[[int], str]


@functools.lru_cache(maxsize=4)
def token_decoder(model: str) -> Decode:
    """id -> text for `model` (a model.path as the job gives it), cached per token."""
    from batchrun.model.weights.loader import load_tokenizer, resolve_path
    from batchrun.model.weights.locate import locate_model

    tokenizer = load_tokenizer(resolve_path(locate_model(model).load_spec))
    return functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))


def _top(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    """The top N of one token's dict (the engine puts them first, best first, then the drawn token)."""
    return list(entry.items())[:top_n]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top_n: int,
                  decode: Decode) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        content.append({**item(token_id, entry[token_id]),
                        "top_logprobs": [item(t, lp) for t, lp in _top(entry, top_n)]})
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top_n: int,
                        decode: Decode) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(token_ids, logprobs):
        text = decode(token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id])
        tops.append({decode(t): lp for t, lp in _top(entry, top_n)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
