"""Sink: where the writer puts rows, in input order, and commits them; the counts and the encoded rows it keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.io.rows import RowTask
from batchrun.output.files import SinkError
from batchrun.output.manifest import PartState
from batchrun.output.parts import PartInfo


@dataclass
class OutputSpec:
    keep_columns: list[str] = field(default_factory=list)
    known_types: dict[str, pa.DataType] = field(default_factory=dict)  # input column -> arrow type
    id_type: pa.DataType | None = None  # None: inferred from the first part
    include_prompt: bool = False
    include_token_ids: bool = False
    sample_index: bool = False
    logprobs: bool = False
    prompt_logprobs: bool = False  # a generation job's sampling.prompt_logprobs (or its sampling column) is set
    truncated_tokens: bool = False  # input.on_too_long truncates: how many prompt tokens each row lost
    model: str = ""
    task: str = "generate"  # the job's task (config.TASKS)
    embedding_dtype: str = "float32"  # task: embed: the embedding column's values (float32 | float16)
    labels: list[str] = field(default_factory=list)  # task: classify: the label names by index (the checkpoint's `id2label`)


@dataclass
class Counts:
    end: int = 0  # input positions covered (committed rows continue from here)
    rows: int = 0  # output rows
    errors: int = 0  # input rows with an error (written or skipped)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    inputs: int = 0  # input positions counted (a run's own count: repairs and retries are not at the end)

    def add(self, other: Counts) -> None:
        self.rows += other.rows
        self.errors += other.errors
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.inputs += other.inputs
        self.end = max(self.end, other.end)

    def remove(self, other: Counts) -> None:
        """Take out what a part held before it was rewritten, or rows an earlier run computed (`end` stays)."""
        self.rows -= other.rows
        self.errors -= other.errors
        self.prompt_tokens -= other.prompt_tokens
        self.completion_tokens -= other.completion_tokens
        self.inputs -= other.inputs

    @classmethod
    def of(cls, info: PartInfo) -> Counts:
        return cls(end=info.end, rows=info.rows, errors=info.errors, prompt_tokens=info.prompt_tokens,
                   completion_tokens=info.completion_tokens, inputs=info.end - info.start)

    def as_dict(self) -> dict[str, int]:
        return {"input_rows": self.end, "output_rows": self.rows, "row_errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}


@dataclass
class StoredRow:
    """A finished row kept aside (the reorder buffer, `_ahead.*`), encoded: written later as `Sink.add` would have."""

    pos: int
    index: int
    id_text: str  # repr of the id, for an on_error: fail message
    error: str | None  # the row error, if any (on_error decides whether the row is written)
    counts: Counts
    payload: list[Any]  # Parquet: output records; OpenAI batch: JSON lines


def row_counts(task: RowTask, outputs: list[Any] | None) -> Counts:
    """What one input row adds to the counts (rows aside: they depend on whether it is written)."""
    error = task.error is not None or any(getattr(o, "error", None) for o in outputs or ()) or (
        outputs is not None and task.continuation_tokens is not None and task.score() is None)
    return Counts(errors=int(error), inputs=1,
                  prompt_tokens=(task.prompt_tokens or 0) if outputs is not None else 0,
                  completion_tokens=sum(len(o.token_ids) for o in outputs) if outputs is not None else 0)


class Sink(ABC):
    def __init__(self, out_dir: Path, spec: OutputSpec, rows_per_part: int, fp_hash: str) -> None:
        self.out_dir = Path(out_dir)
        self.spec = spec
        self.rows_per_part = rows_per_part
        self.fp_hash = fp_hash
        self.accepted: frozenset[str] = frozenset()  # earlier fingerprints whose parts are this output's
        self.checksums = "last"  # which parts' checksums scan() checks: "last" | "all" (OutputStatus says)
        self.committed = Counts()  # everything committed, earlier runs included
        self.pending = Counts()
        self.this_run = Counts()  # committed by this run
        self.carried = Counts()  # of the pending rows, those an earlier run computed (kept aside then)
        self.repairs: list[PartState] = []  # damaged committed parts to compute again (found by open)

    @property
    def pending_rows(self) -> int:
        return self.pending.rows

    def error_rows(self) -> dict[int, list[int]]:
        """Part index -> positions of its written error rows (what --retry-errors computes again)."""
        raise SinkError(f"--retry-errors: not available for the output in {self.out_dir} (Parquet outputs only)")

    def check_columns(self) -> None:
        """Before --retry-errors: warn of output columns the job asks for that the output lacks (Parquet only)."""
        return None

    def replace_part(self, index: int, rows: dict[int, tuple[RowTask, list[Any] | None, bool]]) -> None:
        """Rewrite part `index` in place (ParquetSink); an output without parts cannot."""
        raise SinkError(f"cannot rewrite a part of the output in {self.out_dir} (Parquet outputs only)")

    @abstractmethod
    def scan(self) -> Counts:
        """Read what is committed (no changes on disk); SinkError if the state is inconsistent."""

    @abstractmethod
    def open(self) -> Counts:
        """Clean up leftovers of an interrupted write and prepare to append; returns the committed counts."""

    def add(self, task: RowTask, outputs: list[Any] | None, *, write: bool = True) -> None:
        """The next input row in order (outputs None: a row error); write=False (on_error: skip) only counts it."""
        self.add_stored(self.stored(task, outputs), write=write)

    def stored(self, task: RowTask, outputs: list[Any] | None) -> StoredRow:
        """A finished row, encoded for writing now or later."""
        return StoredRow(task.pos, task.index, repr(task.id), task.error, row_counts(task, outputs),
                         self._payload(task, outputs))

    def add_stored(self, row: StoredRow, *, write: bool = True, earlier: bool = False) -> None:
        """Sink.add for a row kept aside; earlier: read back from `_ahead.*`, not this run's work."""
        self.pending.add(row.counts)
        self.pending.end = row.pos + 1
        rows_before = self.pending.rows
        if write:
            self._add_payload(row)
        if earlier:
            self.carried.add(row.counts)
            self.carried.rows += self.pending.rows - rows_before

    @abstractmethod
    def _payload(self, task: RowTask, outputs: list[Any] | None) -> list[Any]: ...  # one row's output rows, encoded

    @abstractmethod
    def _add_payload(self, row: StoredRow) -> None: ...  # buffered for the next commit

    # ------------------------------------------------------------ rows finished ahead (kept across a stop)

    @abstractmethod
    def save_ahead(self, rows: list[StoredRow]) -> None:
        """Keep rows finished ahead of an earlier one (written after the last commit); [] removes the file."""

    @abstractmethod
    def load_ahead(self) -> list[StoredRow]:
        """What save_ahead kept, beyond what is committed (after open)."""

    @abstractmethod
    def commit(self) -> None:
        """Make the pending rows durable (no-op when nothing is pending)."""

    def _committed_pending(self) -> None:
        self.committed.add(self.pending)
        self.this_run.add(self.pending)
        self.this_run.remove(self.carried)
        self.carried = Counts()
        self.pending = Counts(end=self.committed.end)
