"""JobEngine: what an executor drives; batchrun.llm.LLM, the test fakes and `llm_factory` engines satisfy it."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from batchrun.outputs import RequestOutput
from batchrun.sampling_params import SamplingParams


@runtime_checkable
class JobEngine(Protocol):
    tokenizer: Any  # a Hugging Face fast tokenizer: rows are tokenized and templated with it, before the engine
    max_model_len: int  # the longest prompt plus completion (input.on_too_long cuts prompts to fit it)

    def check_prompt(self, prompt_token_ids: list[int], scored: bool = False) -> str | None:
        """None when the prompt can run, else a one-line reason (the row becomes a row error); a scored prompt
        (its log-probabilities asked for, or max_tokens 0) may fill max_model_len."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    score_from: int = 1) -> None:
        """Queue a checked request; with `params.seed` set, its random stream is a function of the seed. With
        `params.prompt_logprobs`, the prompt is scored from token `score_from` on (loglikelihood rows only pass it)."""
        ...

    def step(self) -> list[RequestOutput]:
        """One engine step: the requests that finished in it, under the caller's `request_id`."""
        ...

    def has_unfinished(self) -> bool: ...
    def abort_all(self) -> None: ...
    def metrics(self) -> dict[str, Any]: ...  # batchrun.engine.metrics.EngineMetrics' names


# "module:callable" that builds the engine instead of batchrun.llm.LLM (dev, tests; it travels to Ray replicas)
LLM_FACTORY_ENV = "BATCHRUN_LLM_FACTORY"


def engine_factory(spec: str | None = None) -> Callable[..., JobEngine]:
    """'module:attr' -> the callable that builds the engine: `spec`, else $BATCHRUN_LLM_FACTORY, else LLM."""
    spec = spec or os.environ.get(LLM_FACTORY_ENV) or "batchrun.llm:LLM"
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr or "LLM")
