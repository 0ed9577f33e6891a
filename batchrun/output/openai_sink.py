"""OpenAI batch output: `output.jsonl`, one line per request. A commit appends lines (fsynced), then replaces
`_progress.json` (input position, byte length) atomically; a rerun cuts `output.jsonl` back to that length."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from batchrun.io.rows import RowTask
from batchrun.output.files import (
    SinkError,
    WriteFailure,
    remove_file,
    write_at,
    write_bytes_atomic,
    write_json_atomic,
)
from batchrun.output.folder import AHEAD_JSONL, OPENAI_OUTPUT, PROGRESS
from batchrun.output.openai_logprobs import (
    Decode,
    DecodeText,
    chat_logprobs,
    completion_logprobs,
    text_decoder,
    token_decoder,
)
from batchrun.output.openai_pooling import pooling_body
from batchrun.output.sink import Counts, OutputSpec, Sink, StoredRow

log = logging.getLogger(__name__)


class OpenAIBatchSink(Sink):
    """OpenAI batch output: one JSON line per request, {id, custom_id, response: {status_code, body}, error}."""

    def __init__(self, out_dir: Path, spec: OutputSpec, rows_per_part: int, fp_hash: str) -> None:
        super().__init__(out_dir, spec, rows_per_part, fp_hash)
        self.lines: list[str] = []
        self.length = 0

    def scan(self) -> Counts:
        path = self.out_dir / PROGRESS
        if not path.exists():
            return Counts()
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError) as e:
            raise SinkError(f"{path} is unreadable ({e}); rerun with --no-resume") from None
        if info.get("fingerprint") != self.fp_hash:
            raise SinkError(f"{self.out_dir / OPENAI_OUTPUT} was written by a different job")
        out = self.out_dir / OPENAI_OUTPUT
        if not out.exists() or out.stat().st_size < info["bytes"]:
            raise SinkError(f"{out} is shorter than {path} records; rerun with --no-resume")
        c = Counts(end=info["end"], rows=info["rows"], errors=info["errors"],
                   prompt_tokens=info["prompt_tokens"], completion_tokens=info["completion_tokens"])
        self.length = info["bytes"]
        return c

    def open(self) -> Counts:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.committed = self.scan()
        self.pending = Counts(end=self.committed.end)
        out = self.out_dir / OPENAI_OUTPUT
        try:
            with open(out, "ab") as f:
                f.truncate(self.length)
        except OSError as e:
            raise WriteFailure(out, e) from None
        return self.committed

    def _payload(self, task: RowTask, outputs: list[Any] | None) -> list[Any]:
        answered = outputs is not None and task.params is not None
        decode = token_decoder(self.spec.model) if answered and task.params.logprobs is not None else None
        decode_text = text_decoder(self.spec.model) if answered and _echo(task) and _echo_ids(task) else None
        return [json.dumps(openai_line(task, outputs, self.spec.model, decode, decode_text=decode_text),
                           ensure_ascii=False)]

    def _add_payload(self, row: StoredRow) -> None:
        self.lines += row.payload
        self.pending.rows += len(row.payload)

    def save_ahead(self, rows: list[StoredRow]) -> None:
        path = self.out_dir / AHEAD_JSONL
        if not rows:
            remove_file(path)
            return
        text = "".join(json.dumps({"pos": r.pos, "index": r.index, "id": r.id_text, "error": r.error,
                                   "counts": [r.counts.errors, r.counts.prompt_tokens, r.counts.completion_tokens],
                                   "lines": r.payload, "fingerprint": self.fp_hash}) + "\n" for r in rows)
        write_bytes_atomic(path, text.encode("utf-8"))

    def load_ahead(self) -> list[StoredRow]:
        path = self.out_dir / AHEAD_JSONL
        rows = []
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    d = json.loads(line)
                    if d["fingerprint"] == self.fp_hash and d["pos"] >= self.committed.end:
                        errors, prompt, completion = d["counts"]
                        rows.append(StoredRow(d["pos"], d["index"], d["id"], d["error"], Counts(
                            errors=errors, prompt_tokens=prompt, completion_tokens=completion, inputs=1), d["lines"]))
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("%s is unreadable (%s): the rows it kept are computed again", path, e)
            return []
        return rows

    def commit(self) -> None:
        if self.pending.end == self.committed.end:
            return
        data = "".join(line + "\n" for line in self.lines).encode("utf-8")
        write_at(self.out_dir / OPENAI_OUTPUT, self.length, data)  # a rerun cuts it to _progress.json's length
        self.length += len(data)
        self._committed_pending()
        write_json_atomic(self.out_dir / PROGRESS, {**self._progress(), "bytes": self.length})
        self.lines = []

    def _progress(self) -> dict[str, Any]:
        c = self.committed
        return {"end": c.end, "rows": c.rows, "errors": c.errors, "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens, "fingerprint": self.fp_hash}


def _echo(task: RowTask) -> bool:
    """A completion that asked `echo`: its text (and logprobs) start with the prompt's."""
    return bool(task.extra and task.extra.get("echo"))


def _echo_ids(task: RowTask) -> bool:
    """Is the echoed prompt its token ids decoded (given as ids, or cut to fit), not the text as given?"""
    return task.prompt_ids is not None and (task.prompt is None or bool(task.truncated))


def openai_line(task: RowTask, outputs: list[Any] | None, model: str, decode: Decode | None = None, *,
                decode_text: DecodeText | None = None) -> dict[str, Any]:
    """One request's output line. decode (token id -> text) renders the logprobs a request asked for;
    decode_text (ids -> text) an echoed prompt that was given as token ids."""
    extra = task.extra or {}
    cid = extra.get("custom_id")  # None for a line that has none (not JSON, or no custom_id)
    digest = hashlib.sha256(f"{cid}:{task.index}".encode()).hexdigest()
    request_id = digest[:32]
    line: dict[str, Any] = {"id": f"batch_req_{digest[:24]}", "custom_id": cid}
    if outputs is None and task.skipped is not None:
        line["response"] = None
        line["error"] = {"code": "skipped", "message": task.skipped}
        return line
    if outputs is None:
        line["response"] = {"status_code": 400, "request_id": request_id, "body": {"error": {
            "message": task.error, "type": "invalid_request_error", "param": None, "code": None}}}
        line["error"] = None
        return line
    if task.pooling is not None or task.pooled is not None:
        line["response"] = {"status_code": 200, "request_id": request_id, "body": pooling_body(task, model, digest)}
        line["error"] = None
        return line
    chat = "chat" in (extra.get("url") or "")
    top_n = task.params.logprobs if task.params is not None else None
    echo = not chat and _echo(task)
    prompt_text = ""
    if echo and decode_text is not None and _echo_ids(task):
        prompt_text = decode_text(task.prompt_ids)
    elif echo:
        prompt_text = task.prompt or ""
    echoed = (task.prompt_ids, task.prompt_logprobs) if echo and task.prompt_ids is not None else None
    choices = []
    for j, out in enumerate(outputs):
        reason = out.finish_reason or "length"
        logprobs = None
        if decode is not None and top_n is not None:
            if chat and out.logprobs is not None:
                logprobs = chat_logprobs(list(out.token_ids), out.logprobs, top_n, decode)
            elif not chat and (out.logprobs is not None or echoed is not None):
                logprobs = completion_logprobs(list(out.token_ids), out.logprobs or [], top_n, decode, echoed)
        if chat:
            choices.append({"index": j, "message": {"role": "assistant", "content": out.text},
                            "logprobs": logprobs, "finish_reason": reason})
        else:
            choices.append({"index": j, "text": prompt_text + out.text, "logprobs": logprobs,
                            "finish_reason": reason})
    completion_tokens = sum(len(o.token_ids) for o in outputs)
    prompt_tokens = task.prompt_tokens or 0
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{digest[:24]}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    line["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    errors = [o.error for o in outputs if getattr(o, "error", None)]
    line["error"] = {"code": "structured_output_incomplete", "message": errors[0]} if errors else None
    return line
