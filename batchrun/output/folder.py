"""An output folder's names, and what is done to it as a whole: its job record, clearing it, checking it is writable."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from batchrun.config import JobError
from batchrun.output.files import TMP_SUFFIX, WriteFailure, remove_file, write_json_atomic
from batchrun.output.manifest import MANIFEST
from batchrun.output.parts import PART_RE, part_files

JOB_FILE = "_job.json"
SUCCESS = "_SUCCESS"
METRICS = "_metrics.json"
PROGRESS = "_progress.json"
OPENAI_OUTPUT = "output.jsonl"
AHEAD = "_ahead.parquet"  # rows finished ahead of an earlier one (OrderedWriter)
AHEAD_JSONL = "_ahead.jsonl"
TMP_RE = re.compile(r"^\.part-\d+\.parquet\.tmp$|^\..*" + re.escape(TMP_SUFFIX) + "$")  # .tmp: earlier versions
STATE_FILES = (JOB_FILE, SUCCESS, METRICS, PROGRESS, OPENAI_OUTPUT, MANIFEST, AHEAD, AHEAD_JSONL)
SHARD_RE = re.compile(r"^shard-(\d+)-of-(\d+)$")  # a job array's shard folders: shard-I-of-N


def fingerprint_hash(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_job_file(out_dir: Path) -> dict[str, Any] | None:
    try:
        with open(out_dir / JOB_FILE, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def clear_output(out_dir: Path) -> int:
    """Remove what batchrun wrote in out_dir (parts, state files), nothing else. Returns files removed.
    The lock file stays: the run that clears holds it."""
    n = 0
    if not out_dir.is_dir():
        return 0
    for p in out_dir.iterdir():
        name = p.name
        if p.is_file() and (PART_RE.match(name) or TMP_RE.match(name) or name in STATE_FILES):
            try:
                p.unlink()
            except OSError as e:
                raise WriteFailure(p, e) from None
            n += 1
    return n


def holds_rows(out_dir: Path) -> bool:
    """Whether out_dir holds rows a run committed or kept aside."""
    return bool(part_files(out_dir)) or any((out_dir / name).exists() for name in (PROGRESS, AHEAD, AHEAD_JSONL))


def check_output_dir(path: Path) -> None:
    """The folder exists and is writable, or can be created (JobError otherwise)."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        raise JobError(f"output.path: {path} cannot be created: {p} is not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise JobError(f"output.path: {path} is not writable ({p} is read-only for this user)")


def probe_output_dir(path: Path) -> None:
    """Create the folder and write a file in it (JobError when that fails)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}.batchrun-tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise JobError(f"output.path: {path} is not writable ({e.strerror or e})") from None


def prepare_folder(out_dir: Path, state: str, damaged: bool, job_record: dict[str, Any]) -> None:
    """Before a run writes rows: a fresh run clears what batchrun wrote before, a damaged output loses `_SUCCESS`
    until it is whole again, and `_job.json` records what the rows are made with (WriteFailure)."""
    if state == "fresh":
        clear_output(out_dir)
    if damaged:
        remove_file(out_dir / SUCCESS)
    write_json_atomic(out_dir / JOB_FILE, job_record)
