"""Output assembly for `LLM`: results in input order, whatever order the engine finishes them in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

from batchrun.beam_search import BeamSearchOutput, BeamSearchSequence
from batchrun.outputs import RequestOutput

T = TypeVar("T")


def in_input_order(finished: Iterable[tuple[int, T]], count: int, *, desc: str, use_tqdm: bool) -> list[T]:
    results: list[T | None] = [None] * count
    bar = tqdm(total=count, desc=desc, disable=not use_tqdm, unit="req")
    try:
        for index, result in finished:
            results[index] = result
            bar.update(1)
    finally:
        bar.close()
    return results  # type: ignore[return-value]


def beam_search_output(prompt_token_ids: list[int], out: RequestOutput) -> BeamSearchOutput:
    """A finished beam request's beams, each with its prompt in front."""
    return BeamSearchOutput([BeamSearchSequence(prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob,
                                                c.finish_reason) for c in out.outputs])
