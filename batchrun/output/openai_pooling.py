"""The response bodies of the pooling endpoints: OpenAI's `/v1/embeddings` (floats or base64 of little-endian
float32), and vLLM's `/v1/score` and `/v1/rerank` (documents by relevance, best first, `top_n` of them)."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from batchrun.io.row_task import RowTask
from batchrun.pooling import cosine


def pooling_body(task: RowTask, model: str, digest: str) -> dict[str, Any]:
    extra, vectors = task.extra or {}, task.pooled or []
    url = extra.get("url")
    tokens = task.prompt_tokens or 0
    if url == "/v1/embeddings":
        encode = _base64 if extra.get("encoding_format") == "base64" else list
        return {"object": "list", "model": model,
                "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    pairs = extra.get("pairs", 0)
    if len(vectors) == pairs:  # a cross-encoder's score per pair
        scores = [v[0] for v in vectors]
    else:  # the cosine of each pair's two embeddings: the first texts', then the second ones'
        scores = [cosine(a, b) for a, b in zip(vectors[:pairs], vectors[pairs:])]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if url == "/v1/score":
        return {"id": f"score-{digest[:24]}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)], "usage": usage}
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: extra.get("top_n") or len(scores)]
    documents = extra.get("documents") or []
    return {"id": f"rerank-{digest[:24]}", "model": model, "usage": usage,
            "results": [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]}


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
