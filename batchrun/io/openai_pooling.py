"""An OpenAI batch line for a pooling endpoint -> one row's pooled prompts: `/v1/embeddings` (OpenAI's body: `input`
a string, a list of strings, a token list or a list of them; `dimensions`), `/v1/score` and `/v1/rerank` (vLLM's
bodies: `text_1` / `text_2`, 1 -> 1, 1 -> N or N -> N; `query`, `documents`, `top_n`)."""

from __future__ import annotations

from typing import Any

from batchrun.io.row_task import RowTask
from batchrun.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")


def pooling_body_problem(url: str, body: dict[str, Any]) -> str | None:
    """Why a pooling request's body cannot run, or None (the line's checks and the row's share it)."""
    if url == "/v1/embeddings":
        given = body.get("input")
        if not _texts_or_tokens(given):
            return "body.input must be a non-empty string, a list of them, a list of token ids or a list of those"
        dims = body.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            return f"body.dimensions must be a positive integer, got {dims!r}"
        if body.get("encoding_format", "float") not in ENCODING_FORMATS:
            return f"body.encoding_format must be float or base64, got {body.get('encoding_format')!r}"
        return None
    if url == "/v1/score":
        first, second = body.get("text_1"), body.get("text_2")
        if not _strings(first) or not _strings(second):
            return "body.text_1 and body.text_2 must each be a non-empty string or a list of them"
        n1, n2 = (1 if isinstance(t, str) else len(t) for t in (first, second))
        if n1 != 1 and n1 != n2:
            return f"body.text_1 has {n1} texts for {n2} in body.text_2 (give 1 -> 1, 1 -> N or N -> N)"
        return None
    query, documents, top_n = body.get("query"), body.get("documents"), body.get("top_n")
    if not isinstance(query, str) or not query:
        return "body.query must be a non-empty string"
    if not isinstance(documents, list) or not documents or not _strings(documents):
        return "body.documents must be a non-empty list of non-empty strings"
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        return f"body.top_n must be a positive integer, got {top_n!r}"
    return None


def pooled_request(task: RowTask, url: str, body: dict[str, Any], tokenizer: Any, scores_by_head: bool) -> None:
    """Set the row's prompts (prompt_ids, more_ids), its engine task and how its answer is written (task.extra);
    a bad body sets task.error."""
    why = pooling_body_problem(url, body)
    if why:
        task.error = why
        return
    extra = task.extra
    if url == "/v1/embeddings":
        given = body["input"]
        items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
        ids = [list(x) if isinstance(x, list) else tokenizer(x)["input_ids"] for x in items]
        task.pooling = ("embed", PoolingParams(dimensions=body.get("dimensions")))
        extra["encoding_format"] = body.get("encoding_format", "float")
    else:
        if url == "/v1/score":
            first, second = ([t] if isinstance(t, str) else list(t) for t in (body["text_1"], body["text_2"]))
            first = first * len(second) if len(first) == 1 else first
        else:
            second, first = list(body["documents"]), [body["query"]] * len(body["documents"])
            extra["documents"], extra["top_n"] = second, body.get("top_n")
        extra["pairs"] = len(second)
        if scores_by_head:  # a cross-encoder: each pair is one prompt
            ids = [list(x) for x in tokenizer(first, second)["input_ids"]]
            task.pooling = ("score", PoolingParams())
        else:  # the cosine of two embeddings: the first texts, then the second ones
            ids = [list(x) for x in tokenizer(first + second)["input_ids"]]
            task.pooling = ("embed", PoolingParams())
    task.prompt_ids, task.more_ids = ids[0], ids[1:]
    task.prompt_tokens = sum(map(len, ids))


def _strings(value: Any) -> bool:
    return (isinstance(value, str) and bool(value)) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value))


def _tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in value)


def _texts_or_tokens(value: Any) -> bool:
    return _strings(value) or _tokens(value) or (isinstance(value, list) and bool(value) and all(map(_tokens, value)))
