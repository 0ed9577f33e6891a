"""OpenAI's objects (file, batch, cursor page, error body) field for field, so that the `openai` SDK parses
ours unchanged. Plain dicts: stored as JSON and served as they are."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from batchrun.io.sources import POOLING_URLS

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", *POOLING_URLS)
COMPLETION_WINDOW = "24h"
COMPLETION_WINDOW_S = 24 * 3600
TERMINAL = ("completed", "failed", "cancelled", "expired")
# OpenAI's limits for one batch input file
MAX_REQUESTS = 50_000
MAX_FILE_BYTES = 200 * 10**6


def now() -> int:
    return int(time.time())


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: a function of the batch, so that finishing a batch again
    after a crash rewrites the same files instead of leaving orphans."""
    return f"file-{hashlib.sha256(f'{batch_id}:{kind}'.encode()).hexdigest()[:24]}"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def file_object(file_id: str, *, size: int, filename: str, purpose: str, created_at: int) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
            "purpose": purpose, "status": "processed", "status_details": None, "expires_at": None}


def request_counts(total: int = 0, completed: int = 0, failed: int = 0) -> dict[str, int]:
    return {"total": total, "completed": completed, "failed": failed}


def usage(input_tokens: int = 0, output_tokens: int = 0) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def batch_object(batch_id: str, *, input_file_id: str, endpoint: str, metadata: dict[str, str] | None,
                 model: str, created_at: int, window_s: int) -> dict[str, Any]:
    """A new batch, validating."""
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "model": model, "errors": None,
            "input_file_id": input_file_id, "completion_window": COMPLETION_WINDOW, "status": "validating",
            "output_file_id": None, "error_file_id": None, "created_at": created_at,
            "in_progress_at": None, "expires_at": created_at + window_s, "finalizing_at": None,
            "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
            "cancelled_at": None, "request_counts": request_counts(), "usage": usage(), "metadata": metadata}


def batch_errors(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """A failed batch's `errors`: [{code, message, param, line}]."""
    return {"object": "list", "data": errors}


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """A cursor page: the `limit` items after the one whose id is `after` (KeyError: no such item)."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else -1
        if start < 0:
            raise KeyError(after)
    data = items[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(items)}
