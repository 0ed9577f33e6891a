"""Executors run a RowSlice's rows through engines and push each finished row to a receiver, in any order."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from batchrun.io.rows import RowTask
from batchrun.io.slicing import RowSlice
from batchrun.outputs import CompletionOutput
from batchrun.pipeline.engine_api import JobEngine

FinishedRow = tuple[RowTask, list[CompletionOutput]]


def max_in_flight(max_num_seqs: int) -> int:
    return max(2 * max_num_seqs, 64)  # keeps the batch full while rows finish and are replaced


class RowReceiver(Protocol):
    """Where rows go (the OrderedWriter): `start` once the engines are up, `put` each finished row (outputs None: a
    row error), `tick` at least once per engine step or block (timed commits run off it); `buffered`: rows unwritten."""

    @property
    def buffered(self) -> int: ...
    def start(self) -> None: ...
    def put(self, task: RowTask, outputs: list[CompletionOutput] | None) -> None: ...
    def tick(self) -> None: ...
    def tick_progress(self) -> None: ...  # progress only; safe from another thread
    def reclaim_signals(self) -> None: ...  # take SIGINT / SIGTERM back after a library replaced the handlers


class Executor(ABC):
    """`run` puts every row of the slice to the receiver, in any order; then `close`, also after a failure."""

    @abstractmethod
    def run(self, rows: RowSlice, receiver: RowReceiver) -> None: ...

    @abstractmethod
    def metrics(self) -> dict[str, Any]: ...  # for _metrics.json; {} before an engine ran

    def progress_metrics(self) -> dict[str, Any]:
        return self.metrics()

    @abstractmethod
    def close(self) -> None: ...


class EngineLoop:
    """One engine's requests in flight: the only map from request id to row, shared by both executors."""

    def __init__(self, engine: JobEngine) -> None:
        self.engine = engine
        self.in_flight: dict[str, RowTask] = {}

    def __len__(self) -> int:
        return len(self.in_flight)

    def add(self, task: RowTask) -> None:  # a row without error: its prompt checked by the RequestBuilder
        request_id = str(task.pos)  # positions are unique in a run, and the same on every rerun
        if task.pooling is not None:  # a pooling row: its prompts, the first under the row's id, the others `id/j`
            prompts = [task.prompt_ids, *(task.more_ids or ())]
            task.pooled, task.more_ids = [None] * len(prompts), None
            for j, ids in enumerate(prompts):
                part = f"{request_id}/{j}" if j else request_id
                self.engine.add_pooling_request(part, ids, *task.pooling)
                self.in_flight[part] = task
        elif task.continuation_tokens:  # a loglikelihood row: its context may come from the prefix cache
            score_from = len(task.prompt_ids) - task.continuation_tokens
            self.engine.add_request(request_id, task.prompt_ids, task.params, score_from=score_from)
        else:
            self.engine.add_request(request_id, task.prompt_ids, task.params)
        task.prompt_ids = None  # the engine holds its own copy; the row waiting here need not
        self.in_flight[request_id] = task

    def step(self) -> list[FinishedRow]:
        if not self.engine.has_unfinished():
            raise RuntimeError(f"internal error: {len(self.in_flight)} requests in flight and the engine is idle")
        finished = []
        for out in self.engine.step():
            task = self.in_flight.pop(out.request_id)
            if task.pooling is not None:
                _, _, j = out.request_id.partition("/")
                task.pooled[int(j or 0)] = out.outputs.data
                if all(v is not None for v in task.pooled):
                    finished.append((task, []))
                continue
            if task.returns_prompt:
                task.prompt_ids, task.prompt_logprobs = list(out.prompt_token_ids), out.prompt_logprobs
            finished.append((task, list(out.outputs)))
        return finished

    def abort(self) -> None:
        if self.in_flight:
            self.engine.abort_all()
            self.in_flight.clear()
