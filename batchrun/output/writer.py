"""OrderedWriter: finished rows, in any order, into the sink in input order, committed on time.

A part is committed at `rows_per_part` rows or after `commit_interval_s`; SIGINT / SIGTERM wait for a commit.
Timed commits and stops also keep the reorder buffer's rows aside (`Sink.save_ahead`) for a rerun to write: a
SIGKILL loses at most `commit_interval_s` of rows, a SIGTERM none. Rows of committed parts go to a PartPatcher."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchrun.io.rows import RowTask
from batchrun.output.patches import PartPatcher
from batchrun.output.signals import Interrupts, JobInterrupted, JobStopped
from batchrun.output.sink import Sink, StoredRow
from batchrun.progress import Progress

log = logging.getLogger(__name__)


class RowFailure(RuntimeError):
    """A row error under on_error: fail (exit 1, rows before it committed)."""


class OrderedWriter:
    def __init__(self, sink: Sink, *, on_error: str, commit_interval_s: float,
                 make_progress: Callable[[int], Progress] | None = None,
                 on_tick: Callable[[float], None] | None = None, stop: threading.Event | None = None) -> None:
        self.sink = sink
        self.on_error = on_error
        self.commit_interval_s = commit_interval_s
        self.make_progress = make_progress  # called at start() with the first position: rows finish from then on
        self.on_tick = on_tick  # called with the time on every tick (the job's time series samples there)
        self.stop = stop  # set by the caller: the next tick raises JobStopped (within one engine step)
        self.interrupts = Interrupts()
        self.next_pos = 0  # the next position to write: every one before it is in the sink
        # The reorder buffer: pos -> a row finished this run (task, outputs), or one kept aside (StoredRow).
        self.buffer: dict[int, tuple[RowTask, list[Any] | None] | StoredRow] = {}
        self.from_earlier = 0  # rows in the buffer that an earlier run finished (read back by open)
        self.ahead: tuple[int, ...] = ()  # their positions: this run does not compute them
        self._earlier: frozenset[int] = frozenset()
        self.unsaved = False  # the buffer changed since it was last kept aside
        self.peak_buffered = 0
        self.last_commit = time.monotonic()
        self.progress: Progress | None = None
        self.done_rows = self.errors = self.generated_tokens = 0  # finished by this run
        self.patcher: PartPatcher | None = None  # rows of committed parts computed again

    # -------------------------------------------------------- lifecycle (the job's side)

    def open(self, *, retry_errors: bool = False) -> int:
        """Open the sink and read back the rows kept aside (`ahead`); returns the position after the committed rows.
        Damaged parts in the middle, and with retry_errors the parts holding error rows, are patched (`redo`)."""
        self.next_pos = self.sink.open().end
        for row in self.sink.load_ahead():
            self.buffer[row.pos] = row
        self.from_earlier = len(self.buffer)
        self.unsaved = True  # the side file, if any, is rewritten (or removed) at the first commit
        self.ahead = tuple(sorted(self.buffer))
        self._earlier = frozenset(self.ahead)
        if self.ahead:
            log.info("%d rows finished by an earlier run ahead of row %d are kept, not computed again",
                     len(self.ahead), self.next_pos)
        parts = {p.index: list(range(p.start, p.end)) for p in self.sink.repairs}
        if retry_errors:
            for index, positions in self.sink.error_rows().items():
                parts.setdefault(index, positions)
        if parts:
            self.patcher = PartPatcher(self.sink, parts, whole={p.index for p in self.sink.repairs})
        return self.next_pos

    @property
    def redo(self) -> tuple[int, ...]:
        """Positions of committed parts this run computes again."""
        return self.patcher.positions if self.patcher is not None else ()

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM raise JobInterrupted inside, except during commits."""
        with self.interrupts.installed():
            yield

    def finish(self) -> None:
        """The executor is done: write and commit every row, and check none is left behind."""
        with self.interrupts.deferred():
            self._drain()  # a row failing the run (on_error: fail) raises here
        self.commit_finished()
        if self.patcher is not None:
            self.patcher.check_done()
        if self.buffer:
            raise RuntimeError(f"internal error: {len(self.buffer)} rows unwritten after the executor finished "
                               f"(the next due is position {self.next_pos})")

    def commit_finished(self) -> None:
        """Commit the finished rows in order (up to one failing the run), keep the rest aside, flush the patches."""
        with self.interrupts.deferred():
            try:
                self._drain()
            except RowFailure:
                pass
            self._commit(keep_ahead=True)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """A section that signals do not interrupt (clean-up after a failure)."""
        return self.interrupts.held()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

    # -------------------------------------------------------- the executor's side (RowReceiver)

    @property
    def buffered(self) -> int:
        """Rows this run finished, not yet written. Rows read back from an earlier run do not count: the row they
        wait for may not be read yet, and the executor's bound is on what this run holds."""
        return len(self.buffer) - self.from_earlier

    def start(self) -> None:
        self.progress = self.make_progress(self.next_pos) if self.make_progress is not None else None
        self.last_commit = time.monotonic()

    def put(self, task: RowTask, outputs: list[Any] | None) -> None:
        self.done_rows += 1
        if outputs is None:
            self.errors += 1
        else:
            self.generated_tokens += sum(len(o.token_ids) for o in outputs)
        if self.progress is not None:
            self.progress.update(self.done_rows, self.generated_tokens, self.errors)
        if self.patcher is not None and self.patcher.wants(task.pos):
            with self.interrupts.deferred():
                self._check_row(task.error, task.index, repr(task.id))
                self.patcher.put(task, outputs, self._writes(task.error))
            return
        with self.interrupts.deferred():
            self.buffer[task.pos] = (task, outputs)
            self.unsaved = True
            self.peak_buffered = max(self.peak_buffered, self.buffered)
            self._drain()

    def tick(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise JobStopped()
        now = time.monotonic()
        patched = self.patcher is not None and self.patcher.held
        if (self.sink.pending_rows or patched or self.unsaved) and now - self.last_commit >= self.commit_interval_s:
            with self.interrupts.deferred():
                self._commit(keep_ahead=True)
        if self.progress is not None:
            self.progress.tick(now)
        if self.on_tick is not None:
            self.on_tick(now)

    def tick_progress(self) -> None:  # from another thread: commits stay on the main thread
        if self.progress is not None:
            self.progress.tick()

    def reclaim_signals(self) -> None:
        self.interrupts.reinstall()

    # -------------------------------------------------------- writing

    def _drain(self) -> None:
        while self.next_pos in self.buffer:
            entry = self.buffer[self.next_pos]
            row = entry if isinstance(entry, StoredRow) else None
            if row is not None:
                self._check_row(row.error, row.index, row.id_text)
            else:
                self._check_row(entry[0].error, entry[0].index, repr(entry[0].id))
            del self.buffer[self.next_pos]
            self.unsaved = True
            if row is not None:
                earlier = row.pos in self._earlier
                self.from_earlier -= earlier
                self.sink.add_stored(row, write=self._writes(row.error), earlier=earlier)
            else:
                self.sink.add(*entry, write=self._writes(entry[0].error))
            self.next_pos += 1
            if self.sink.pending_rows >= self.sink.rows_per_part:
                self._commit()
        if time.monotonic() - self.last_commit >= self.commit_interval_s and (self.sink.pending_rows or self.unsaved):
            self._commit(keep_ahead=True)

    def _check_row(self, error: str | None, index: int, id_text: str) -> None:
        if error is not None and self.on_error == "fail":
            raise RowFailure(f"row {index} (id {id_text}): {error} (input.on_error: fail)")

    def _writes(self, error: str | None) -> bool:
        """Does the row get output rows (an error row: only with on_error: record)?"""
        return error is None or self.on_error == "record"

    def _commit(self, *, keep_ahead: bool = False) -> None:
        """The pending rows as a part; keep_ahead (timed commits, stops): the buffer kept aside, patches flushed."""
        self.sink.commit()
        if keep_ahead:
            self._keep_ahead()
            if self.patcher is not None:
                self.patcher.flush()
        self.last_commit = time.monotonic()

    def _keep_ahead(self) -> None:
        """The buffer's rows to the side file, after the commit before them (a kill between the two leaves a side
        file whose committed rows are skipped when read back)."""
        if not self.unsaved:
            return
        for pos, entry in self.buffer.items():
            if not isinstance(entry, StoredRow):
                self.buffer[pos] = self.sink.stored(*entry)  # encoded once, kept encoded
        self.sink.save_ahead([self.buffer[pos] for pos in sorted(self.buffer)])
        self.unsaved = False


__all__ = ["OrderedWriter", "RowFailure", "JobInterrupted", "JobStopped"]
