"""Output writers: an ordered Parquet folder of atomic parts, or OpenAI batch output JSONL; both resumable.

Parquet: rows arrive in input order and collect in memory until `rows_per_part` output rows; a part is
written to ``.part-NNNNN.parquet.batchrun-tmp``, fsynced and renamed to ``part-NNNNN.parquet``
(batchrun.io.files). Each part's footer
records the input positions it covers (``start``, ``end``), its counts and the job fingerprint, so the
parts themselves are the resume state: a rerun continues at the last part's ``end``.

OpenAI batch: lines are appended to ``output.jsonl``, fsynced, then ``_progress.json`` (input position and
byte length) is replaced atomically; a rerun truncates ``output.jsonl`` to the recorded length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.files import (
    SinkError,
    WriteFailure,
    remove_quietly,
    write_at,
    write_bytes_atomic,
    write_json_atomic,
)
from batchrun.io.rows import RowTask

__all__ = ["SinkError", "WriteFailure", "write_json_atomic"]  # re-exported: the job and merge write through them

log = logging.getLogger(__name__)

JOB_FILE = "_job.json"
SUCCESS = "_SUCCESS"
METRICS = "_metrics.json"
PROGRESS = "_progress.json"
OPENAI_OUTPUT = "output.jsonl"
PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
TMP_RE = re.compile(r"^\.part-\d+\.parquet\.tmp$|^\..*\.batchrun-tmp$")  # .tmp: the name earlier versions used
META_KEY = b"batchrun"


@dataclass
class OutputSpec:
    keep_columns: list[str] = field(default_factory=list)
    known_types: dict[str, pa.DataType] = field(default_factory=dict)  # input column -> arrow type
    id_type: pa.DataType | None = None  # None: inferred from the first part
    include_prompt: bool = False
    include_token_ids: bool = False
    sample_index: bool = False
    logprobs: bool = False
    model: str = ""


@dataclass
class Counts:
    end: int = 0  # input positions covered (committed rows continue from here)
    rows: int = 0  # output rows
    errors: int = 0  # input rows with an error (written or skipped)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: Counts) -> None:
        self.rows += other.rows
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.end = max(self.end, other.end)

    def as_dict(self) -> dict[str, int]:
        return {"input_rows": self.end, "output_rows": self.rows, "row_errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


# ---------------------------------------------------------------- the output folder


def fingerprint_hash(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_job_file(out_dir: Path) -> dict[str, Any] | None:
    try:
        with open(out_dir / JOB_FILE, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def clear_output(out_dir: Path) -> int:
    """Remove what batchrun wrote in out_dir (parts, state files), nothing else. Returns files removed."""
    n = 0
    if not out_dir.is_dir():
        return 0
    for p in out_dir.iterdir():
        name = p.name
        if p.is_file() and (PART_RE.match(name) or TMP_RE.match(name) or
                            name in (JOB_FILE, SUCCESS, METRICS, PROGRESS, OPENAI_OUTPUT)):
            try:
                p.unlink()
            except OSError as e:
                raise WriteFailure(p, e) from None
            n += 1
    return n


def part_files(out_dir: Path) -> list[Path]:
    if not out_dir.is_dir():
        return []
    parts = [p for p in out_dir.iterdir() if PART_RE.match(p.name)]
    return sorted(parts, key=lambda p: int(PART_RE.match(p.name).group(1)))


# ---------------------------------------------------------------- rows


def output_records(task: RowTask, outputs: list[Any] | None, spec: OutputSpec) -> list[dict[str, Any]]:
    """One record per sample (one for an error row), with the output columns."""
    base: dict[str, Any] = {"id": task.id}
    for c in spec.keep_columns:
        base[c] = task.keep.get(c)
    if spec.include_prompt:
        base["prompt"] = task.prompt
    if outputs is None:
        rec = {**base, "completion": None, "finish_reason": "error", "prompt_tokens": task.prompt_tokens,
               "completion_tokens": 0, "error": task.error}
        if spec.sample_index:
            rec["sample_index"] = 0
        return [rec]
    recs = []
    for j, out in enumerate(outputs):
        # a structured output cut off before its grammar completed keeps its text, with the error beside it
        rec = {**base, "completion": out.text, "finish_reason": out.finish_reason or "length",
               "prompt_tokens": task.prompt_tokens, "completion_tokens": len(out.token_ids),
               "error": getattr(out, "error", None)}
        if spec.sample_index:
            rec["sample_index"] = out.index if out.index is not None else j
        if spec.include_token_ids:
            rec["token_ids"] = list(out.token_ids)
        if spec.logprobs:
            rec["logprobs"] = [list(d.items()) for d in out.logprobs] if out.logprobs is not None else None
        recs.append(rec)
    return recs


class Sink(ABC):
    """Common part: counts, pending rows, commit bookkeeping."""

    def __init__(self, out_dir: Path, spec: OutputSpec, rows_per_part: int, fp_hash: str) -> None:
        self.out_dir = Path(out_dir)
        self.spec = spec
        self.rows_per_part = rows_per_part
        self.fp_hash = fp_hash
        self.committed = Counts()  # everything committed, earlier runs included
        self.pending = Counts()
        self.this_run = Counts()  # committed by this run

    @property
    def pending_rows(self) -> int:
        return self.pending.rows

    @abstractmethod
    def scan(self) -> Counts:
        """Read what is committed (no changes on disk); SinkError if the state is inconsistent."""

    @abstractmethod
    def open(self) -> Counts:
        """Clean up leftovers of an interrupted write and prepare to append; returns the committed counts."""

    def add(self, task: RowTask, outputs: list[Any] | None, *, write: bool = True) -> None:
        """The next input row in order: its outputs (None for an error row). write=False skips it but
        still counts its position (on_error: skip)."""
        self.pending.end = task.pos + 1
        if task.error is not None or any(getattr(o, "error", None) for o in outputs or ()):
            self.pending.errors += 1
        self.pending.prompt_tokens += (task.prompt_tokens or 0) if outputs is not None else 0
        if outputs is not None:
            self.pending.completion_tokens += sum(len(o.token_ids) for o in outputs)
        if write:
            self._add(task, outputs)

    @abstractmethod
    def _add(self, task: RowTask, outputs: list[Any] | None) -> None:
        """Buffer one row's output rows for the next commit."""

    @abstractmethod
    def commit(self) -> None:
        """Make the pending rows durable (no-op when nothing is pending)."""

    def _committed_pending(self) -> None:
        self.committed.add(self.pending)
        self.this_run.add(self.pending)
        self.pending = Counts(end=self.committed.end)


class ParquetSink(Sink):
    def __init__(self, out_dir: Path, spec: OutputSpec, rows_per_part: int, fp_hash: str) -> None:
        super().__init__(out_dir, spec, rows_per_part, fp_hash)
        self.columns: dict[str, list[Any]] = {}
        self.schema: pa.Schema | None = None
        self.next_part = 0

    def column_names(self) -> list[str]:
        s = self.spec
        names = ["id", *[c for c in s.keep_columns if c != "id"]]
        if s.include_prompt:
            names.append("prompt")
        if s.sample_index:
            names.append("sample_index")
        names += ["completion", "finish_reason", "prompt_tokens", "completion_tokens"]
        if s.include_token_ids:
            names.append("token_ids")
        if s.logprobs:
            names.append("logprobs")
        names.append("error")
        return names

    FIXED_TYPES = {
        "prompt": pa.string(), "sample_index": pa.int32(), "completion": pa.string(),
        "finish_reason": pa.string(), "prompt_tokens": pa.int32(), "completion_tokens": pa.int32(),
        "token_ids": pa.list_(pa.int32()), "logprobs": pa.list_(pa.map_(pa.int64(), pa.float64())),
        "error": pa.string(),
    }

    def scan(self) -> Counts:
        counts = Counts()
        for i, p in enumerate(part_files(self.out_dir)):
            try:
                meta = pq.read_schema(p).metadata or {}
                info = json.loads(meta[META_KEY])
            except (OSError, pa.ArrowException, KeyError, ValueError) as e:
                raise SinkError(f"{p} is not a readable batchrun part ({e}); remove it, or rerun with --no-resume") from None
            if int(PART_RE.match(p.name).group(1)) != i or info.get("start") != counts.end:
                raise SinkError(f"{p}: the parts in {self.out_dir} are not contiguous (expected part {i} "
                                f"starting at row {counts.end}); rerun with --no-resume")
            if info.get("fingerprint") != self.fp_hash:
                raise SinkError(f"{p} was written by a different job")
            counts.add(Counts(end=info["end"], rows=info["rows"], errors=info["errors"],
                              prompt_tokens=info["prompt_tokens"], completion_tokens=info["completion_tokens"]))
        return counts

    def open(self) -> Counts:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for p in self.out_dir.iterdir():
            if TMP_RE.match(p.name):
                remove_quietly(p)
        self.committed = self.scan()
        self.pending = Counts(end=self.committed.end)
        parts = part_files(self.out_dir)
        self.next_part = len(parts)
        if parts:
            self.schema = pq.read_schema(parts[0]).remove_metadata()
        self.columns = {n: [] for n in self.column_names()}
        return self.committed

    def _add(self, task: RowTask, outputs: list[Any] | None) -> None:
        for rec in output_records(task, outputs, self.spec):
            for name, values in self.columns.items():
                values.append(rec.get(name))
            self.pending.rows += 1

    def _type_of(self, name: str, values: list[Any]) -> pa.DataType:
        if name in self.FIXED_TYPES:
            return self.FIXED_TYPES[name]
        known = self.spec.id_type if name == "id" else self.spec.known_types.get(name)
        if known is not None:
            return known
        inferred = pa.array(values).type
        return pa.string() if pa.types.is_null(inferred) else inferred

    def _array(self, name: str, values: list[Any], typ: pa.DataType) -> pa.Array:
        try:
            return pa.array(values, type=typ)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            if pa.types.is_string(typ) or pa.types.is_large_string(typ):
                return pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str)
                                 for v in values], type=typ)
            raise SinkError(f"output column {name!r}: a value does not fit the column type {typ} "
                            f"(taken from the earlier rows): {str(e).splitlines()[0]}") from None

    def commit(self) -> None:
        if self.pending.end == self.committed.end:
            return
        names = self.column_names()
        if self.schema is None:
            self.schema = pa.schema([pa.field(n, self._type_of(n, self.columns[n])) for n in names])
        arrays = [self._array(f.name, self.columns[f.name], f.type) for f in self.schema]
        info = {"start": self.committed.end, "end": self.pending.end, "rows": self.pending.rows,
                "errors": self.pending.errors, "prompt_tokens": self.pending.prompt_tokens,
                "completion_tokens": self.pending.completion_tokens, "fingerprint": self.fp_hash}
        schema = self.schema.with_metadata({META_KEY: json.dumps(info).encode()})
        table = pa.Table.from_arrays(arrays, schema=schema)
        name = f"part-{self.next_part:05d}.parquet"
        write_bytes_atomic(self.out_dir / name, parquet_bytes(table))
        log.debug("committed %s: input rows %d..%d, %d output rows", name, info["start"], info["end"],
                  info["rows"])
        self.next_part += 1
        self._committed_pending()
        self.columns = {n: [] for n in names}


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

    def _add(self, task: RowTask, outputs: list[Any] | None) -> None:
        self.lines.append(json.dumps(openai_line(task, outputs, self.spec.model), ensure_ascii=False))
        self.pending.rows += 1

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


def parquet_bytes(table: pa.Table) -> pa.Buffer:
    """A part's file, in memory: written in one go, and its checksum taken without reading it back."""
    stream = pa.BufferOutputStream()
    pq.write_table(table, stream)
    return stream.getvalue()


def openai_line(task: RowTask, outputs: list[Any] | None, model: str) -> dict[str, Any]:
    extra = task.extra or {}
    cid = extra.get("custom_id", task.id)
    digest = hashlib.sha256(f"{cid}:{task.index}".encode()).hexdigest()
    request_id = digest[:32]
    line: dict[str, Any] = {"id": f"batch_req_{digest[:24]}", "custom_id": cid}
    if outputs is None:
        line["response"] = {"status_code": 400, "request_id": request_id, "body": {"error": {
            "message": task.error, "type": "invalid_request_error", "param": None, "code": None}}}
        line["error"] = None
        return line
    chat = "chat" in (extra.get("url") or "")
    choices = []
    for j, out in enumerate(outputs):
        reason = out.finish_reason or "length"
        if chat:
            choices.append({"index": j, "message": {"role": "assistant", "content": out.text},
                            "logprobs": None, "finish_reason": reason})
        else:
            choices.append({"index": j, "text": out.text, "logprobs": None, "finish_reason": reason})
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
