"""The end of a batch: its job's output.jsonl split into the output file (status 200) and the error file, with
the counts and usage; a cancelled or expired batch also gets an error line for each request that did not run.
Idempotent: the result files' ids are a function of the batch, and only the lines _progress.json records as
committed are read (a crash may leave a torn line after them)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from batchrun.output.folder import OPENAI_OUTPUT, PROGRESS
from batchrun.serve import shapes
from batchrun.serve.checks import Checked
from batchrun.serve.store import StateStore

NOT_RUN = {"cancelled": ("batch_cancelled", "The batch was cancelled before this request ran."),
           "expired": ("batch_expired", "This request could not be executed before the completion window "
                                        "expired.")}


def progress(job_dir: Path) -> dict[str, Any] | None:
    """What the job has committed so far (_progress.json), None before its first commit."""
    try:
        with open(job_dir / PROGRESS, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def live_counts(job_dir: Path, total: int) -> tuple[dict[str, int], dict[str, Any]]:
    """request_counts and usage of a running batch, from its committed lines."""
    done = progress(job_dir) or {}
    end, errors = done.get("end", 0), done.get("errors", 0)
    return (shapes.request_counts(total, end - errors, errors),
            shapes.usage(done.get("prompt_tokens", 0), done.get("completion_tokens", 0)))


def finish(store: StateStore, batch_id: str, outcome: str) -> dict[str, Any]:
    """Write the output and error files of a batch that ended (completed, cancelled or expired); returns
    the batch object's fields that change."""
    job_dir = store.job_dir(batch_id)
    checks_path = store.checks_path(batch_id)
    checked = Checked.load(checks_path) if checks_path.exists() else None
    done = progress(job_dir) or {"end": 0, "bytes": 0}
    files = {kind: _ResultFile(store, batch_id, kind) for kind in ("output", "error")}
    completed = failed = input_tokens = output_tokens = 0
    try:
        for raw in _committed_lines(job_dir / OPENAI_OUTPUT, done["bytes"]):
            line = json.loads(raw)
            response = line.get("response")
            if response is not None and response.get("status_code") == 200:
                completed += 1
                files["output"].write(raw)
                body_usage = response["body"].get("usage") or {}
                input_tokens += body_usage.get("prompt_tokens", 0)
                output_tokens += body_usage.get("completion_tokens", 0)
            else:
                failed += 1
                files["error"].write(raw)
        total = checked.requests if checked is not None else _count_requests(store.input_path(batch_id))
        if outcome in NOT_RUN and done["end"] < total:
            code, message = NOT_RUN[outcome]
            for index, custom_id in _custom_ids(store.input_path(batch_id), done["end"], checked):
                digest = hashlib.sha256(f"{custom_id}:{index}".encode()).hexdigest()
                files["error"].write(json.dumps({"id": f"batch_req_{digest[:24]}", "custom_id": custom_id,
                                                 "response": None, "error": {"code": code, "message": message}},
                                                ensure_ascii=False).encode())
    except BaseException:
        for f in files.values():
            f.discard()
        raise
    return {"output_file_id": files["output"].close(), "error_file_id": files["error"].close(),
            "request_counts": shapes.request_counts(total, completed, failed),
            "usage": shapes.usage(input_tokens, output_tokens)}


def _committed_lines(path: Path, length: int):
    """The lines in the first `length` bytes of the job's output (what _progress.json says is committed)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        read = 0
        for raw in f:
            read += len(raw)
            if read > length:
                return
            yield raw.rstrip(b"\n")


class _ResultFile:
    """One result file, written under a temporary name and recorded only if it has lines."""

    def __init__(self, store: StateStore, batch_id: str, kind: str) -> None:
        self.store, self.batch_id, self.kind = store, batch_id, kind
        self.file_id = shapes.result_file_id(batch_id, kind)
        self.tmp = store.files_dir / f".{self.file_id}.result"
        self.f = open(self.tmp, "wb")
        self.lines = 0

    def write(self, line: bytes) -> None:
        self.f.write(line + b"\n")
        self.lines += 1

    def discard(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def close(self) -> str | None:
        self.f.close()
        if not self.lines:
            self.tmp.unlink(missing_ok=True)
            self.store.delete_file(self.file_id)
            return None
        self.store.add_file(self.file_id, self.tmp, filename=f"{self.batch_id}_{self.kind}.jsonl",
                            purpose="batch_output", lines=self.lines)
        return self.file_id


def _requests(path: Path):
    """(index, line) of each request (non-blank line), as batchrun.serve.checks counts them."""
    with open(path, "rb") as f:
        index = 0
        for raw in f:
            if raw.strip():
                yield index, raw
                index += 1


def _count_requests(path: Path) -> int:
    return sum(1 for _ in _requests(path))


def _custom_ids(path: Path, start: int, checked: Checked | None):
    """(index, custom_id or None) of the requests from `start` on."""
    for index, raw in _requests(path):
        if index < start:
            continue
        problem = checked.problems.get(index) if checked is not None else None
        if problem is not None:
            yield index, problem.custom_id
            continue
        try:
            custom_id = json.loads(raw).get("custom_id")
        except (ValueError, AttributeError):
            custom_id = None
        yield index, custom_id if isinstance(custom_id, str) else None
