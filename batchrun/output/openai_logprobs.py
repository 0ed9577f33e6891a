"""OpenAI's chat and completions `logprobs` objects, from CompletionOutput.logprobs' per-token {token id: logprob}
and, for a completion's `echo`, RequestOutput.prompt_logprobs.

A token's text is what it decodes to alone (part of a multi-byte character: U+FFFD, as other OpenAI-compatible
servers). The writer has no engine: it loads the tokenizer itself, once per process, when a row asks for logprobs
or echoes a prompt given as token ids."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

Decode = Callable[[int], str]
DecodeText = Callable[[list[int]], str]
MIN_LOGPROB = -9999.0  # what a JSON answer shows for -inf (an impossible token), as vLLM does


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Any:
    from batchrun.model.weights.loader import load_tokenizer, resolve_path
    from batchrun.model.weights.locate import locate_model

    return load_tokenizer(resolve_path(locate_model(model).load_spec))


@functools.lru_cache(maxsize=4)
def token_decoder(model: str) -> Decode:
    """id -> text for `model` (a model.path as the job gives it), cached per token."""
    tokenizer = _tokenizer(model)
    return functools.lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))


def text_decoder(model: str) -> DecodeText:
    """ids -> their text for `model` (an echo of a prompt given as token ids)."""
    tokenizer = _tokenizer(model)
    return lambda ids: tokenizer.decode(ids)


def _value(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def _top(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    """The top N of one token's dict, best first. It holds the N most likely and the token itself: the N
    largest are the N most likely whatever the token's rank."""
    return sorted(entry.items(), key=lambda item: -float(item[1]))[:top_n]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top_n: int,
                  decode: Decode) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        content.append({**item(token_id, entry[token_id]),
                        "top_logprobs": [item(t, lp) for t, lp in _top(entry, top_n)]})
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, float]], top_n: int, decode: Decode,
                        prompt: tuple[list[int], list[dict[int, float] | None] | None] | None = None
                        ) -> dict[str, Any]:
    """OpenAI's legacy object: per token its text, log-probability, {text: log-probability} of the top_n most
    likely (two tokens of one text: the likelier) and offset in the tokens' texts joined. prompt: an echo's
    (prompt token ids, their prompt log-probabilities), put before the generated tokens; the first prompt token
    (and every one, when they were not computed) has None for its log-probability and top."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0

    def add(token_id: int, entry: dict[int, float] | None) -> None:
        nonlocal offset
        text = decode(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            return
        token_logprobs.append(_value(entry[token_id]))
        top: dict[str, float] = {}
        for t, lp in _top(entry, top_n):
            top.setdefault(decode(t), _value(lp))
        tops.append(top)

    if prompt is not None:
        prompt_ids, prompt_logprobs = prompt
        for i, token_id in enumerate(prompt_ids):
            add(token_id, prompt_logprobs[i] if prompt_logprobs is not None else None)
    for token_id, entry in zip(token_ids, logprobs):
        add(token_id, entry)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
