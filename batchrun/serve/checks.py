"""A batch's input checked line by line before it runs: the envelope (custom_id, method, url) and the body's
fields, which the engine does not see. A bad line becomes an error line of its own (batchrun.serve.source puts
it in place) and the others run; what the engine checks itself fails its line the same way, in the pipeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.io.openai_pooling import pooling_body_problem
from batchrun.sampling_params import SamplingParams

# Body fields read (besides the SamplingParams fields, vLLM's extensions, which pass through as well).
HONOURED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
            "seed", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "response_format", "echo"}
# Body fields that change nothing about the answer: accepted and ignored. (model: one model serves.)
IGNORED = {"model", "user", "store", "metadata", "service_tier", "stream_options", "parallel_tool_calls",
           "prompt_cache_key", "safety_identifier"}
MAX_TOP_LOGPROBS = 20
# the body fields each pooling endpoint reads (besides IGNORED)
POOLING_KEYS = {"/v1/embeddings": {"input", "dimensions", "encoding_format"},
                "/v1/score": {"text_1", "text_2"}, "/v1/rerank": {"query", "documents", "top_n"}}


@dataclass
class Problem:
    line: int  # 1-based line number in the file
    custom_id: str | None  # None when the line has no usable one
    message: str


@dataclass
class Checked:
    """requests: the non-blank lines (each one output or error line); problems by request index."""

    requests: int = 0
    problems: dict[int, Problem] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        data = {"requests": self.requests,
                "problems": {str(i): [p.line, p.custom_id, p.message] for i, p in self.problems.items()}}
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Checked:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(data["requests"], {int(i): Problem(*p) for i, p in data["problems"].items()})


def check_input(path: Path, endpoint: str) -> Checked:
    """Every line of a batch input file against the batch's endpoint."""
    checked = Checked()
    seen: dict[str, int] = {}  # custom_id -> the line it first appeared on
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            index = checked.requests
            checked.requests += 1
            custom_id, why = _check_line(raw, endpoint)
            if custom_id is not None:
                if why is None and custom_id in seen:
                    why = f"duplicate custom_id {custom_id!r} (first on line {seen[custom_id]})"
                seen.setdefault(custom_id, number)
            if why is not None:
                checked.problems[index] = Problem(number, custom_id, f"line {number}: {why}")
    return checked


def _check_line(raw: bytes, endpoint: str) -> tuple[str | None, str | None]:
    """(custom_id, None) for a line that can go to the engine, else (custom_id or None, why not)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"not valid JSON ({getattr(e, 'msg', None) or e})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object {{custom_id, method, url, body}}, got {type(obj).__name__}"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, "custom_id must be a non-empty string"
    if obj.get("method", "POST") != "POST":
        return custom_id, f"method must be POST, got {obj.get('method')!r}"
    url = obj.get("url")
    if url != endpoint:
        return custom_id, f"url {url!r} is not the batch's endpoint {endpoint}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return custom_id, "body must be a JSON object"
    return custom_id, _check_body(body, endpoint)


def _check_body(body: dict[str, Any], endpoint: str) -> str | None:
    if endpoint in POOLING_KEYS:
        unknown = next((k for k in body if k not in POOLING_KEYS[endpoint] and k not in IGNORED), None)
        if unknown is not None:
            return f"body.{unknown} is not supported for {endpoint} by batchrun serve"
        return pooling_body_problem(endpoint, body)
    chat = endpoint == "/v1/chat/completions"
    if chat and "messages" not in body:
        return "body.messages is required for /v1/chat/completions"
    if not chat and "prompt" not in body:
        return "body.prompt is required for /v1/completions"
    if not chat and "messages" in body:
        return "body.messages is for /v1/chat/completions; /v1/completions takes body.prompt"
    passed = set(SamplingParams.field_names())
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        return f"body.echo must be true or false, got {echo!r}"
    if chat and echo:
        return "body.echo is for /v1/completions; chat completions do not echo the prompt"
    if chat:
        for key in ("max_tokens", "max_completion_tokens"):
            if body.get(key) == 0 and not isinstance(body[key], bool):
                return f"body.{key} must be at least 1 for chat completions, got 0"
    if body.get("prompt_logprobs") is not None:  # a completion's come with echo: true and logprobs: k
        return ("body.prompt_logprobs is not supported by batchrun serve; /v1/completions with echo: true and "
                "logprobs: k returns the prompt's log-probabilities")
    for key, value in body.items():
        if key in HONOURED or key in IGNORED or key in passed or value in (None, False, [], {}):
            continue
        if key == "best_of" and value == 1:
            continue
        return f"body.{key} is not supported by batchrun serve"
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            return f"body.logprobs must be true or false for chat completions, got {logprobs!r}"
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
                return f"body.top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top!r}"
            if not logprobs:
                return "body.top_logprobs needs body.logprobs: true"
    elif logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                   or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        return f"body.logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} for completions, got {logprobs!r}"
    return None
