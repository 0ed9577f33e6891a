"""What the job layer needs from an engine: the `JobEngine` protocol.

The executors drive an engine themselves (add requests while under their in-flight bound, step, hand the
finished rows on), so they need a handful of stepping methods, not `LLM`'s whole surface. `batchrun.llm.LLM`
satisfies this protocol; so do the test fakes (tests/test_job_fakes.py) and any engine a caller plugs in
through the `llm_factory` hook.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from batchrun.outputs import RequestOutput
from batchrun.sampling_params import SamplingParams


@runtime_checkable
class JobEngine(Protocol):
    """An engine the job layer can drive, one step at a time."""

    # A Hugging Face (fast) tokenizer: rows are tokenized and chat templates rendered with it, in batches,
    # before they reach the engine.
    tokenizer: Any
    # The longest prompt plus completion a request may have (input.on_too_long cuts prompts to fit it).
    max_model_len: int

    def check_prompt(self, prompt_token_ids: list[int]) -> str | None:
        """None when the prompt can run, else a one-line reason (the row becomes a row error)."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue one request (already checked). `params.seed` set: its random stream is a function of it."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the requests that finished in it, their `request_id` the caller's."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request added is not yet returned by `step`."""
        ...

    def abort_all(self) -> None:
        """Drop every request in flight (a run stopping half way)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges (batchrun.engine.metrics.EngineMetrics' names), for progress and _metrics.json."""
        ...


# Dev / test hook: "module:callable" used instead of batchrun.llm.LLM to build the engine (it travels to
# Ray replicas with the other BATCHRUN_* variables).
LLM_FACTORY_ENV = "BATCHRUN_LLM_FACTORY"


def engine_factory(spec: str | None = None) -> Callable[..., JobEngine]:
    """'module:attr' -> the callable that builds the engine: `spec`, else $BATCHRUN_LLM_FACTORY, else LLM."""
    spec = spec or os.environ.get(LLM_FACTORY_ENV) or "batchrun.llm:LLM"
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr or "LLM")
