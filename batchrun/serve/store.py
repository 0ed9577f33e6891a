"""The state folder of `batchrun serve` (its layout: docs/serve.md): uploaded files, each batch's record,
input and job folder; one server at a time (a flock on STATE/.lock). A file appears under its id only once
whole (written under a temporary name, then renamed). The records are also kept in memory: the lock makes
this process their only writer. Internal fields start with "_" and never reach a client."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from batchrun.output.files import write_json_atomic
from batchrun.serve import shapes

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class StoreError(Exception):
    """The state folder cannot be used (locked by another server, not writable): exit 2."""


class LimitError(Exception):
    """An upload over a limit (400, with this message)."""


def public(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("_")}


class StateStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self.lock = threading.RLock()  # every change of a record, and the runner's status transitions
        self._lock_file: Any = None
        self._files: dict[str, dict[str, Any]] = {}
        self._batches: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------ opening

    def open(self) -> StateStore:
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            self.batches_dir.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / ".lock", "a+")
        except OSError as e:
            raise StoreError(f"--state-dir: {self.root} is not usable ({e.strerror or e})") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise StoreError(f"--state-dir: {self.root} is in use by another batchrun serve (pid {holder})") from None
            raise StoreError(f"--state-dir: cannot lock {self.root / '.lock'} ({e.strerror or e})") from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock_file = lock
        self._load()
        return self

    def close(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None

    def _load(self) -> None:
        for p in self.files_dir.iterdir():
            if p.name.startswith("."):  # an upload or result file cut short by a crash
                p.unlink(missing_ok=True)
            elif p.suffix == ".json":
                record = _read_json(p)
                if record is not None and (self.files_dir / record["id"]).exists():
                    self._files[record["id"]] = record
        for d in self.batches_dir.iterdir():
            record = _read_json(d / "batch.json")
            if record is not None:
                self._batches[record["id"]] = record
        log.info("state folder %s: %d files, %d batches", self.root, len(self._files), len(self._batches))

    # ------------------------------------------------------------ files

    def save_upload(self, stream: BinaryIO, *, filename: str, purpose: str, max_bytes: int,
                    max_lines: int | None) -> dict[str, Any]:
        """Copy an upload into the store, counting its bytes and non-blank lines; LimitError past a limit."""
        file_id = shapes.new_file_id()
        tmp = self.files_dir / f".{file_id}.upload"
        size = lines = 0
        open_line = False  # the current line has a non-blank byte
        try:
            with open(tmp, "wb") as out:
                while chunk := stream.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise LimitError(f"the file is larger than the limit of {max_bytes:,} bytes for a batch "
                                         "input file")
                    pieces = chunk.split(b"\n")
                    for piece in pieces[:-1]:
                        lines += open_line or bool(piece.strip())
                        open_line = False
                    open_line = open_line or bool(pieces[-1].strip())
                    if max_lines is not None and lines > max_lines:
                        raise LimitError(f"the file has more than {max_lines:,} requests (lines), the limit of a "
                                         "batch input file; split it into several batches")
                    out.write(chunk)
                lines += open_line
                if max_lines is not None and lines > max_lines:
                    raise LimitError(f"the file has more than {max_lines:,} requests (lines), the limit of a "
                                     "batch input file; split it into several batches")
                out.flush()
                os.fsync(out.fileno())
            return self.add_file(file_id, tmp, filename=filename, purpose=purpose, lines=lines)
        finally:
            tmp.unlink(missing_ok=True)

    def add_file(self, file_id: str, path: Path, *, filename: str, purpose: str,
                 lines: int | None = None) -> dict[str, Any]:
        """Move a finished file (in files_dir) under its id and record it; replaces a file of that id."""
        record = shapes.file_object(file_id, size=path.stat().st_size, filename=filename, purpose=purpose,
                                    created_at=shapes.now())
        record["_order"] = time.time_ns()
        record["_lines"] = lines
        os.replace(path, self.files_dir / file_id)
        with self.lock:
            write_json_atomic(self.files_dir / f"{file_id}.json", record)
            self._files[file_id] = record
        return record

    def file(self, file_id: str) -> dict[str, Any] | None:
        return self._files.get(file_id)

    def files(self) -> list[dict[str, Any]]:
        """Oldest first."""
        with self.lock:
            return sorted(self._files.values(), key=lambda r: r["_order"])

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def delete_file(self, file_id: str) -> bool:
        with self.lock:
            if self._files.pop(file_id, None) is None:
                return False
            (self.files_dir / f"{file_id}.json").unlink(missing_ok=True)  # first: no record without bytes
            (self.files_dir / file_id).unlink(missing_ok=True)
        return True

    # ------------------------------------------------------------ batches

    def batch_dir(self, batch_id: str) -> Path:
        return self.batches_dir / batch_id

    def input_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "input.jsonl"

    def checks_path(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "checks.json"

    def job_dir(self, batch_id: str) -> Path:
        return self.batch_dir(batch_id) / "job"

    def create_batch(self, record: dict[str, Any]) -> dict[str, Any]:
        """Record a new batch with its own link to the input file's bytes."""
        batch_id = record["id"]
        folder = self.batch_dir(batch_id)
        folder.mkdir()
        source = self.file_path(record["input_file_id"])
        try:
            os.link(source, self.input_path(batch_id))
        except OSError:  # a file system without hard links
            shutil.copyfile(source, self.input_path(batch_id))
        with self.lock:
            record["_seq"] = max((b["_seq"] for b in self._batches.values()), default=0) + 1
            self._write(record)
        return record

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        with self.lock:
            record = self._batches.get(batch_id)
            return None if record is None else json.loads(json.dumps(record))

    def batches(self) -> list[dict[str, Any]]:
        """Oldest first (the order they run in)."""
        with self.lock:
            return [json.loads(json.dumps(r)) for r in sorted(self._batches.values(), key=lambda r: r["_seq"])]

    def update_batch(self, batch_id: str, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """change(record) edits a copy of the record in place; the result is written atomically and returned."""
        with self.lock:
            record = json.loads(json.dumps(self._batches[batch_id]))
            change(record)
            self._write(record)
            return json.loads(json.dumps(record))

    def _write(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.batch_dir(record["id"]) / "batch.json", record)
        self._batches[record["id"]] = record


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
