"""What an output folder holds for a job: fresh, resume, complete or retry; read when planning and again under
the run's lock, since another run may have written the folder in between."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun.config import JobError
from batchrun.output.files import SinkError
from batchrun.output.folder import SUCCESS, fingerprint_hash, holds_rows, probe_output_dir, read_job_file
from batchrun.output.lock import OutputBusy, OutputLock
from batchrun.output.openai_sink import OpenAIBatchSink
from batchrun.output.parquet import ParquetSink
from batchrun.output.sink import OutputSpec, Sink


@dataclass(frozen=True)
class OutputTarget:
    """Where a job's rows go and what they are made with: fixed by the plan, before any model loads."""

    out_dir: Path
    spec: OutputSpec
    rows_per_part: int
    fingerprint: dict[str, Any]
    openai: bool = False  # OpenAI batch output (one JSONL file), else Parquet parts

    @property
    def fp_hash(self) -> str:
        return fingerprint_hash(self.fingerprint)


@dataclass
class OutputStatus:
    state: str = "fresh"  # fresh | resume | complete | retry
    committed: int = 0  # input rows already committed
    damaged: list[str] = field(default_factory=list)  # committed parts found damaged (computed again)
    unrecorded: int = 0  # sound parts the manifest has no entry for (the run records them)
    accepted: frozenset[str] = frozenset()  # earlier fingerprints of this output's parts (kept by a retry)
    checksums: str = "last"  # parts whose checksum is checked: the last on a resume, all on a complete output
    notes: list[str] = field(default_factory=list)


def make_sink(target: OutputTarget, status: OutputStatus) -> Sink:
    cls = OpenAIBatchSink if target.openai else ParquetSink
    sink = cls(target.out_dir, target.spec, target.rows_per_part, target.fp_hash)
    sink.accepted, sink.checksums = status.accepted, status.checksums
    return sink


def read_status(target: OutputTarget, *, resume: bool = True, retry_errors: bool = False,
                notes: list[str] | None = None) -> OutputStatus:
    """The folder's status for this job; JobError (exit 2) when it holds another job's rows, or cannot be resumed.
    The parts are checked against their manifest: a damaged part makes a complete output resume."""
    out = target.out_dir
    status = OutputStatus(notes=list(notes or []))
    if not resume:
        return status
    if not holds_rows(out):
        if retry_errors:
            raise JobError(f"--retry-errors: {out} holds no output yet; run the job without it first")
        return status
    old = read_job_file(out)
    earlier = set(old.get("earlier_fingerprints", [])) if old else set()
    if old is not None and fingerprint_hash(old.get("fingerprint", {})) != target.fp_hash:
        changes = _describe_changes(old.get("fingerprint", {}), target.fingerprint)
        if not retry_errors:
            raise JobError(f"output.path: {out} holds rows of a different job ({changes}); rerun with "
                           "--no-resume to start afresh, or choose another output.path")
        earlier.add(fingerprint_hash(old.get("fingerprint", {})))  # a job fixed before retrying its errors
        note = f"the job changed since the output was written ({changes}); the rows with an error are " \
               "computed again with the new one"
        if note not in status.notes:
            status.notes.append(note)
    status.accepted = frozenset(earlier - {target.fp_hash})
    done = (out / SUCCESS).exists()
    # what an interruption can damage is the last part (docs/durability.md: "What a rerun checks")
    status.checksums = "all" if done else "last"
    sink = make_sink(target, status)
    try:
        counts = sink.scan()
    except SinkError as e:
        raise JobError(f"output.path: cannot resume: {e}") from None
    inspection = getattr(sink, "inspection", None)
    status.damaged = [f"{p.path.name} ({p.damage})" for p in inspection.damaged] if inspection else []
    status.unrecorded = len(inspection.unrecorded()) if inspection else 0
    status.committed = counts.end
    if retry_errors:
        if target.openai:
            raise JobError("--retry-errors: not available for openai-batch output yet (Parquet outputs only)")
        if not done:
            raise JobError(f"--retry-errors: {out} is not complete (no _SUCCESS); run the job without "
                           "--retry-errors to finish it first")
        status.state = "retry"
    else:
        status.state = "complete" if done and not status.damaged else "resume"
    return status


@contextlib.contextmanager
def held(target: OutputTarget, status: OutputStatus, *, resume: bool, retry_errors: bool) -> Iterator[OutputStatus]:
    """The folder locked for one run, and its status read again under the lock (another run may have written it
    since the plan). JobError when another run holds it; WriteFailure when the lock cannot be written."""
    probe_output_dir(target.out_dir)
    lock = OutputLock(target.out_dir, "run")
    try:
        lock.acquire()
    except OutputBusy as e:
        raise JobError(f"output.path: {e}") from None
    try:
        yield read_status(target, resume=resume, retry_errors=retry_errors, notes=status.notes)
    finally:
        lock.release()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _describe_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    a, b = _flatten(old), _flatten(new)
    diffs = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k) and k != "version"]
    return "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "") or "unknown change"
