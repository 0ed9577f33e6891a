"""RowTask: one input row as the engine's request and, once run, its answer; the leaf the row builders share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from batchrun.io.sources import Row
from batchrun.sampling_params import SamplingParams


@dataclass
class RowTask:
    pos: int  # position in this run's stream of input rows (0-based within the shard)
    index: int  # global row index in the whole input
    id: Any
    keep: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None  # the text the model sees (rendered chat template for messages)
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    params: SamplingParams | None = None
    error: str | None = None
    extra: dict[str, Any] | None = None  # openai-batch: custom_id, url, model, echo
    truncated: int | None = None  # prompt tokens cut to fit (input.on_too_long: truncate_left / truncate_right)
    skipped: str | None = None  # why it is not run, by the job's choice (input.on_too_long: skip)
    # the engine's RequestOutput.prompt_logprobs, when params.prompt_logprobs asked them (prompt_ids are then back)
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    continuation_tokens: int | None = None  # task: loglikelihood: the continuation's tokens, the prompt's last ones
    # a pooling row (task: embed / classify / score, or a pooling request of an OpenAI batch): (the engine's pooling
    # task, its PoolingParams); the further prompts it pools (a score's second text, an embeddings request's other
    # inputs, a rerank's documents); once run, one answer per prompt, the first one's first
    pooling: tuple[str, Any] | None = None
    more_ids: list[list[int]] | None = None
    pooled: list[list[float] | None] | None = None

    @property
    def runs(self) -> bool:
        """Does the row go to the engine (else it is finished as it is: an error, or skipped)?"""
        return self.error is None and self.skipped is None

    def score(self) -> tuple[float, bool] | None:
        """task: loglikelihood, once run: (the continuation's summed log-probability, whether each of its tokens is
        the most likely at its position: greedy decoding after the context gives it); None when the engine gave
        no log-probability for one of them."""
        n, ids, entries = self.continuation_tokens, self.prompt_ids, self.prompt_logprobs
        if not n or ids is None or entries is None or len(entries) != len(ids) or n >= len(ids):
            return None
        picked = []
        for token, entry in zip(ids[-n:], entries[-n:]):
            if entry is None or token not in entry:
                return None
            picked.append(entry[token])
        return math.fsum(picked), all(getattr(lp, "rank", None) == 1 for lp in picked)

    @property
    def returns_prompt(self) -> bool:
        """Does its output need the prompt's token ids back (their log-probabilities, an OpenAI `echo`)?"""
        return (self.params is not None and self.params.prompt_logprobs is not None) or bool(
            self.extra and self.extra.get("echo"))


def text_problem(row: Row, column: str, *, empty_ok: bool = False) -> str | None:
    """Why a row's text cell cannot be scored (missing, null, not a string, empty), or None."""
    if column not in row:
        return f"column {column!r} is missing in this row"
    value = row[column]
    if value is None:
        return f"{column} is null"
    if not isinstance(value, str):
        return f"{column} is not a string ({type(value).__name__})"
    if not value and not empty_ok:
        return f"{column} is empty"
    return None
