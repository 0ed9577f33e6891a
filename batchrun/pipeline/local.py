"""LocalExecutor: one engine in this process, given rows while under the in-flight and reorder bounds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchrun.io.rows import RequestBuilder
from batchrun.io.slicing import RowSlice
from batchrun.pipeline.engine_api import JobEngine
from batchrun.pipeline.executor import EngineLoop, Executor, RowReceiver, max_in_flight

if TYPE_CHECKING:
    from batchrun.plan import JobPlan

log = logging.getLogger(__name__)


class LocalExecutor(Executor):
    REORDER_FACTOR = 4  # rows finished or in flight but not yet written: at most this x max_in_flight

    def __init__(self, plan: JobPlan, factory: Callable[..., JobEngine]) -> None:
        self.cfg, self.source, self.id_column = plan.cfg, plan.source, plan.id_column
        self.kv_cache_tokens = plan.kv_cache_tokens
        self.factory = factory
        self.max_in_flight = max_in_flight(self.cfg.engine["max_num_seqs"])
        self.reorder_limit = self.REORDER_FACTOR * self.max_in_flight
        self.engine: JobEngine | None = None
        self.loop: EngineLoop | None = None

    def run(self, rows: RowSlice, receiver: RowReceiver) -> None:
        cfg = self.cfg
        if rows.empty:  # every row is committed (or finished ahead): no model to load
            receiver.start()
            return
        if getattr(self.factory, "loads_model", True):  # False: it hands an engine loaded before (batchrun serve's)
            log.info("loading model %s", cfg.model["path"])
        kwargs = cfg.llm_kwargs()
        if self.kv_cache_tokens is not None:
            kwargs["kv_cache_tokens"] = self.kv_cache_tokens
        self.engine = engine = self.factory(cfg.model["path"], **kwargs)
        builder = RequestBuilder(cfg, source_format=self.source.format, tokenizer=engine.tokenizer,
                                 check_prompt=engine.check_prompt, id_column=self.id_column,
                                 check_structured=getattr(engine, "check_structured", None),
                                 max_model_len=getattr(engine, "max_model_len", None),
                                 pooling=getattr(engine, "pooling", None))
        self.loop = loop = EngineLoop(engine)
        receiver.start()
        for batch in rows.read(self.source, builder.columns()):
            for task in builder.build(batch):
                receiver.tick()
                # Rows in flight can all finish behind a slow one: they count against the buffer's bound. When
                # it is full the oldest unwritten row is in flight (else the buffer would drain): a step frees room.
                while len(loop) >= self.max_in_flight or len(loop) + receiver.buffered >= self.reorder_limit:
                    self._step(receiver)
                if not task.runs:  # a row error, or skipped: never reaches the engine
                    receiver.put(task, None)
                else:
                    loop.add(task)
        while len(loop):  # the input is read: step until the last row is back
            self._step(receiver)

    def _step(self, receiver: RowReceiver) -> None:
        assert self.loop is not None
        for task, outputs in self.loop.step():
            receiver.put(task, outputs)
        receiver.tick()

    def metrics(self) -> dict[str, Any]:
        return dict(self.engine.metrics()) if self.engine is not None else {}

    def close(self) -> None:
        if self.loop is not None:
            self.loop.abort()
