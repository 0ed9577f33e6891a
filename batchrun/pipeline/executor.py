"""The executor interface: run a RowSlice's rows through engines and push every finished row to a receiver.

An executor yields finished rows in any order (the receiver, an OrderedWriter, puts them back in input
order); it knows nothing of parts, commits or signals. Two implement it: `LocalExecutor`
(batchrun.pipeline.local, one engine in this process) and `RayExecutor` (batchrun.distributed.ray_executor,
engine replicas on a Ray cluster). Both build their requests with batchrun.io.rows.RequestBuilder and drive
their engines with `EngineLoop`, so a row gives the same output whichever runs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from batchrun.io.rows import RowTask
from batchrun.io.slicing import RowSlice
from batchrun.outputs import CompletionOutput
from batchrun.pipeline.engine_api import JobEngine

FinishedRow = tuple[RowTask, list[CompletionOutput]]


def max_in_flight(max_num_seqs: int) -> int:
    """Requests an engine is given at once: enough to keep its batch full while rows finish and are replaced."""
    return max(2 * max_num_seqs, 64)


class RowReceiver(Protocol):
    """Where an executor pushes its rows (batchrun.output.writer.OrderedWriter)."""

    @property
    def buffered(self) -> int:
        """Rows received but not yet written (finished ahead of an earlier one)."""
        ...

    def start(self) -> None:
        """The engines are up (called once, before the first row): progress and the commit clock start."""
        ...

    def put(self, task: RowTask, outputs: list[CompletionOutput] | None) -> None:
        """One finished row; outputs None for a row error."""
        ...

    def tick(self) -> None:
        """Called at least once per engine step or block of results: timed commits and progress run off it."""
        ...

    def tick_progress(self) -> None:
        """Progress only; safe from another thread."""
        ...

    def reclaim_signals(self) -> None:
        """Take SIGINT / SIGTERM back after a library replaced their handlers."""
        ...


class Executor(ABC):
    """Runs one job's rows: `run` is called once, then `close`."""

    @abstractmethod
    def run(self, rows: RowSlice, receiver: RowReceiver) -> None:
        """Generate every row of `rows` and `put` each to `receiver`, in any order; return once all are put."""

    @abstractmethod
    def metrics(self) -> dict[str, Any]:
        """The engine metrics for _metrics.json ({} before an engine ran)."""

    def progress_metrics(self) -> dict[str, Any]:
        """The gauges the progress line shows (running / waiting / swapped, KV in use)."""
        return self.metrics()

    @abstractmethod
    def close(self) -> None:
        """Release what `run` started (engines, cluster work); called once, also after a failure."""


class EngineLoop:
    """The requests one engine is generating. Their rows wait here, in the one map from request id to row,
    until the engine hands the request back."""

    def __init__(self, engine: JobEngine) -> None:
        self.engine = engine
        self.in_flight: dict[str, RowTask] = {}

    def __len__(self) -> int:
        return len(self.in_flight)

    def add(self, task: RowTask) -> None:
        """Queue a row that has no error (its prompt checked by the RequestBuilder)."""
        request_id = str(task.pos)  # positions are unique in a run, and the same on every rerun
        self.engine.add_request(request_id, task.prompt_ids, task.params)
        task.prompt_ids = None  # the engine holds its own copy; the row waiting here need not
        self.in_flight[request_id] = task

    def step(self) -> list[FinishedRow]:
        """One engine step: the rows that finished in it."""
        if not self.engine.has_unfinished():
            raise RuntimeError(f"internal error: {len(self.in_flight)} requests in flight and the engine is idle")
        return [(self.in_flight.pop(out.request_id), list(out.outputs)) for out in self.engine.step()]

    def abort(self) -> None:
        """Drop whatever is still generating (a run stopped half way)."""
        if self.in_flight:
            self.engine.abort_all()
            self.in_flight.clear()
