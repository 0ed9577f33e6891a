"""OrderedWriter: finished rows, in any order, back into input order and into the sink, committed on time.

It owns the reorder buffer (rows finished ahead of an earlier one still generating; the local executor
bounds it by holding back input), the sink, the commit clock and the signals: a part is committed when it
holds `rows_per_part` rows, or when `commit_interval_s` has passed since the last commit (checked whenever
the executor hands over a row or ticks), so a SIGKILL loses at most that much work. SIGINT / SIGTERM
arriving during a commit wait for it to finish. Rows of parts already committed that are computed again (a
damaged part, `--retry-errors`) go to a PartPatcher instead (batchrun.pipeline.patches).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from batchrun.io.rows import RowTask
from batchrun.io.sinks import Sink
from batchrun.pipeline.patches import PartPatcher
from batchrun.pipeline.signals import Interrupts, JobInterrupted
from batchrun.progress import Progress

log = logging.getLogger(__name__)


class RowFailure(RuntimeError):
    """A row error under on_error: fail (exit 1, rows before it committed)."""


class OrderedWriter:
    def __init__(self, sink: Sink, *, on_error: str, commit_interval_s: float,
                 make_progress: Callable[[int], Progress] | None = None,
                 on_tick: Callable[[float], None] | None = None) -> None:
        self.sink = sink
        self.on_error = on_error
        self.commit_interval_s = commit_interval_s
        self.make_progress = make_progress  # called at start() with the first position: rows finish from then on
        self.on_tick = on_tick  # called with the time on every tick (the job's time series samples there)
        self.interrupts = Interrupts()
        self.next_pos = 0  # the next position to write: every one before it is in the sink
        self.buffer: dict[int, tuple[RowTask, list[Any] | None]] = {}  # the reorder buffer: pos -> row
        self.peak_buffered = 0
        self.last_commit = time.monotonic()
        self.progress: Progress | None = None
        self.done_rows = self.errors = self.generated_tokens = 0  # finished by this run
        self.patcher: PartPatcher | None = None  # rows of committed parts computed again

    # -------------------------------------------------------- lifecycle (the job's side)

    def open(self, *, retry_errors: bool = False) -> int:
        """Open the sink (clean up an interrupted write); returns the position after the committed rows.
        Damaged parts the sink found in the middle, and with retry_errors the parts holding error rows, are
        patched: their positions are in `redo`."""
        self.next_pos = self.sink.open().end
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
        self.commit_finished()
        if self.patcher is not None:
            self.patcher.check_done()
        if self.buffer:
            raise RuntimeError(f"internal error: {len(self.buffer)} rows unwritten after the executor finished "
                               f"(the next due is position {self.next_pos})")

    def commit_finished(self) -> None:
        """Commit every finished row that is in order (up to a row that fails the run), signals held off."""
        with self.interrupts.deferred():
            try:
                self._drain()
            except RowFailure:
                pass
            self._commit()
            if self.patcher is not None:
                self.patcher.flush()

    def held(self) -> contextlib.AbstractContextManager[None]:
        """A section that signals do not interrupt (clean-up after a failure)."""
        return self.interrupts.held()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()

    # -------------------------------------------------------- the executor's side (RowReceiver)

    @property
    def buffered(self) -> int:
        """Rows finished but not yet written (waiting for an earlier one)."""
        return len(self.buffer)

    def start(self) -> None:
        """The engines are up: the progress bar and the commit clock start now."""
        self.progress = self.make_progress(self.next_pos) if self.make_progress is not None else None
        self.last_commit = time.monotonic()

    def put(self, task: RowTask, outputs: list[Any] | None) -> None:
        """One finished row (outputs None for a row error), in any order."""
        self.done_rows += 1
        if outputs is None:
            self.errors += 1
        else:
            self.generated_tokens += sum(len(o.token_ids) for o in outputs)
        if self.progress is not None:
            self.progress.update(self.done_rows, self.generated_tokens, self.errors)
        if self.patcher is not None and self.patcher.wants(task.pos):
            with self.interrupts.deferred():
                self._check_row(task)
                self.patcher.put(task, outputs, self._writes(task))
            return
        with self.interrupts.deferred():
            self.buffer[task.pos] = (task, outputs)
            self.peak_buffered = max(self.peak_buffered, len(self.buffer))
            self._drain()

    def tick(self) -> None:
        """Called often (every engine step, every block of results): commits on time, keeps progress alive."""
        now = time.monotonic()
        patched = self.patcher is not None and self.patcher.held
        if (self.sink.pending_rows or patched) and now - self.last_commit >= self.commit_interval_s:
            with self.interrupts.deferred():
                self._commit()
                if self.patcher is not None:
                    self.patcher.flush()
        if self.progress is not None:
            self.progress.tick(now)
        if self.on_tick is not None:
            self.on_tick(now)

    def tick_progress(self) -> None:
        """Progress only, from another thread (commits stay on the main thread)."""
        if self.progress is not None:
            self.progress.tick()

    def reclaim_signals(self) -> None:
        """Take SIGINT / SIGTERM back after a library replaced the handlers (ray.init does)."""
        self.interrupts.reinstall()

    # -------------------------------------------------------- writing

    def _drain(self) -> None:
        while self.next_pos in self.buffer:
            task, outputs = self.buffer[self.next_pos]
            self._check_row(task)
            del self.buffer[self.next_pos]
            self.sink.add(task, outputs, write=self._writes(task))
            self.next_pos += 1
            if self.sink.pending_rows >= self.sink.rows_per_part:
                self._commit()
        if self.sink.pending_rows and time.monotonic() - self.last_commit >= self.commit_interval_s:
            self._commit()

    def _check_row(self, task: RowTask) -> None:
        if task.error is not None and self.on_error == "fail":
            raise RowFailure(f"row {task.index} (id {task.id!r}): {task.error} (input.on_error: fail)")

    def _writes(self, task: RowTask) -> bool:
        """Does the row get output rows (an error row: only with on_error: record)?"""
        return task.error is None or self.on_error == "record"

    def _commit(self) -> None:
        self.sink.commit()
        self.last_commit = time.monotonic()


__all__ = ["OrderedWriter", "RowFailure", "JobInterrupted"]
