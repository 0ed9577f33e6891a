"""The Ray Data stages: the Indexer and the engine replicas.

Seeds, ids and resume need a row index Ray Data lacks: one sequential Indexer actor stamps it in input order.
EngineReplica builds requests as the local executor does and returns each row's pickled (RowTask, outputs)."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import uuid
from typing import Any

import pyarrow as pa

from batchrun.io.rows import RequestBuilder, RowTask
from batchrun.io.slicing import RowSlice
from batchrun.pipeline.engine_api import engine_factory
from batchrun.pipeline.executor import EngineLoop, max_in_flight

log = logging.getLogger(__name__)

POS, INDEX, WHERE, LINE = "__batchrun_pos", "__batchrun_index", "__batchrun_where", "__batchrun_line"
RESULT, REPLICA, METRICS = "__batchrun_result", "__batchrun_replica", "__batchrun_metrics"
CALLS = "__batchrun_calls"
GEN = "__batchrun_indexer"  # which Indexer instance stamped a row: a restarted one would count from zero


class Indexer:
    """Stamps row indices and positions on blocks that arrive in input order, keeping this run's rows only.
    start: the global index of the first row it sees."""

    def __init__(self, *, start: int, rows: RowSlice, text: bool = False) -> None:
        self.next = start
        self.rows = rows
        self.text = text
        self.generation = uuid.uuid4().hex

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.text:
            return self._lines(batch)
        n = batch.num_rows
        keep, pos = [], []
        for i in range(n):
            p = self.rows.position_of(self.next + i)
            if p is not None:
                keep.append(i)
                pos.append(p)
        indices = [self.next + i for i in keep]
        self.next += n
        out = batch.take(pa.array(keep, pa.int64())) if len(keep) < n else batch
        out = out.append_column(POS, pa.array(pos, pa.int64())).append_column(INDEX, pa.array(indices, pa.int64()))
        return out.append_column(GEN, pa.array([self.generation] * len(pos), pa.string()))

    def _lines(self, batch: pa.Table) -> pa.Table:
        """Whole JSONL files (bytes, path) -> one row per non-blank line, as batchrun.io.sources reads them."""
        lines, where, pos, indices = [], [], [], []
        for data, path in zip(batch.column("bytes").to_pylist(), batch.column("path").to_pylist()):
            name = os.path.basename(path)
            text = io.StringIO(data.decode("utf-8"), newline=None)  # universal newlines, as open() reads
            for lineno, line in enumerate(text, 1):
                if not line.strip():
                    continue
                p = self.rows.position_of(self.next)
                if p is not None:
                    lines.append(line)
                    where.append(f"{name} line {lineno}")
                    pos.append(p)
                    indices.append(self.next)
                self.next += 1
        return pa.table({LINE: pa.array(lines, pa.large_string()), WHERE: pa.array(where, pa.string()),
                         POS: pa.array(pos, pa.int64()), INDEX: pa.array(indices, pa.int64()),
                         GEN: pa.array([self.generation] * len(pos), pa.string())})


class EngineReplica:
    """One batchrun engine. Each call runs one batch of rows through it and returns one row per input row."""

    def __init__(self, *, cfg: Any, source_format: str, id_column: str | None, factory: Any,
                 data_columns: list[str], parser: Any = None) -> None:
        self.cfg = cfg
        self.data_columns = data_columns
        self.parser = parser  # a JsonlSource: its _parse turns a line into a row (or a row error)
        make = factory if callable(factory) else engine_factory(factory)
        self.llm = make(cfg.model["path"], **cfg.llm_kwargs())
        self.builder = RequestBuilder(cfg, source_format=source_format, tokenizer=self.llm.tokenizer,
                                      check_prompt=self.llm.check_prompt, id_column=id_column,
                                      check_structured=getattr(self.llm, "check_structured", None),
                                      max_model_len=getattr(self.llm, "max_model_len", None),
                                      pooling=getattr(self.llm, "pooling", None))
        self.columns = self.builder.columns()
        self.max_in_flight = max_in_flight(cfg.engine["max_num_seqs"])
        self.keep_prompt = cfg.output["include_prompt"]
        self.name = f"{os.uname().nodename}:{os.getpid()}"
        self.calls = 0  # batches need not run in input order: the driver keeps each replica's latest metrics

    def _rows(self, batch: pa.Table) -> list[dict[str, Any]]:
        if self.parser is None:
            return batch.select(self.data_columns).to_pylist()
        from batchrun.io.sources import ROW_ERROR

        rows = []
        for line, where in zip(batch.column(LINE).to_pylist(), batch.column(WHERE).to_pylist()):
            row = self.parser._parse(line, where)
            if self.columns is not None and ROW_ERROR not in row:
                row = {c: row.get(c) for c in self.columns if c in row}
            rows.append(row)
        return rows

    def _generate(self, tasks: list[RowTask]) -> list[tuple[RowTask, list[Any] | None]]:
        """Every row of a batch through the engine (row errors skip it), in the batch's order."""
        loop = EngineLoop(self.llm)
        rows: list[tuple[RowTask, list[Any] | None]] = []
        try:
            for task in tasks:
                if not task.runs:
                    rows.append((task, None))
                    continue
                while len(loop) >= self.max_in_flight:
                    rows += loop.step()
                loop.add(task)
            while len(loop):
                rows += loop.step()
        finally:
            loop.abort()  # a failure half way leaves nothing behind in the engine
        return sorted(rows, key=lambda row: row[0].pos)

    def __call__(self, batch: pa.Table) -> pa.Table:
        items = zip(batch.column(POS).to_pylist(), batch.column(INDEX).to_pylist(), self._rows(batch))
        tasks = self.builder.build(list(items))
        rows = self._generate(tasks)
        results = []
        for task, outputs in rows:
            task.params = None  # the sink needs neither params nor prompt ids; keep the payload small
            if not self.keep_prompt:
                task.prompt = None
            results.append(pickle.dumps((task, outputs), protocol=pickle.HIGHEST_PROTOCOL))
        n = len(rows)
        metrics = [None] * n
        self.calls += 1
        if n:
            metrics[-1] = json.dumps({**self.llm.metrics(), CALLS: self.calls}, default=float)
        return pa.table({POS: pa.array([task.pos for task, _ in rows], pa.int64()), GEN: batch.column(GEN),
                         RESULT: pa.array(results, pa.binary()),
                         REPLICA: pa.array([self.name] * n, pa.string()), METRICS: pa.array(metrics, pa.string())})
