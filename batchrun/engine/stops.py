"""Whether a sequence is done after its newest token: EOS, a stop token, a stop string, or its length."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.request import Sequence
from batchrun.sampling_params import SamplingParams


@dataclass(slots=True)
class StopRule:
    """A sequence's stop conditions worked out once for the engine's fast path: stop_decision's decisions."""

    stop_reasons: dict[int, int | None]  # a token that stops it -> stop_reason (EOS: None, a stop token: itself)
    min_len: int  # len(token_ids) from which it may stop (prompt + min_tokens)
    max_len: int  # len(token_ids) at which it stops for length


def stop_rule(params: SamplingParams, eos_token_ids: tuple[int, ...], prompt_len: int,
              max_model_len: int) -> StopRule:
    reasons: dict[int, int | None] = {t: t for t in params.stop_token_ids}
    if not params.ignore_eos:
        reasons.update((t, None) for t in eos_token_ids)  # EOS first: its stop_reason is None
    max_len = min(prompt_len + (max_model_len if params.max_tokens is None else params.max_tokens), max_model_len)
    return StopRule(reasons, prompt_len + params.min_tokens, max_len)


def stop_decision(seq: Sequence, params: SamplingParams, token: int, eos_token_ids: tuple[int, ...],
                  max_model_len: int, grammar_ended: bool = False) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) when `token` (appended) ends the sequence, else None. Before min_tokens only
    the length limits and an ended grammar stop it; every token but a stop token reaches the detokenizer."""
    n = seq.num_output
    can_stop = n >= params.min_tokens
    if can_stop and ((not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids):
        seq.detok.finish(seq.token_ids[seq.prompt_len : -1])  # the stop token is not text
        return "stop", None if not params.ignore_eos and token in eos_token_ids else token
    hit = seq.detok.add(token)
    decision: tuple[str, int | str | None] | None = None
    if hit is not None and can_stop:
        decision = "stop", hit
    elif grammar_ended:
        decision = "stop", None
    elif n >= (max_model_len if params.max_tokens is None else params.max_tokens) or len(seq.token_ids) >= max_model_len:
        decision = "length", None
    if decision is not None:
        seq.detok.finish(seq.token_ids[seq.prompt_len :])
    return decision


def banned_until_min_tokens(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The ids a sequence may not draw before min_tokens: its stop tokens, and EOS unless ignored."""
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


INCOMPLETE_AT_LENGTH = "structured output is incomplete: max_tokens reached before the grammar completed"
INCOMPLETE_AT_STOP = "structured output is incomplete: generation stopped before the grammar completed"


def structured_error(seq: Sequence) -> str | None:
    """The error of a finished constrained sequence whose text is not a complete match, else None."""
    g = seq.grammar
    if g is None or g.is_terminated() or g.is_completed():
        return None
    return INCOMPLETE_AT_LENGTH if seq.finish_reason == "length" else INCOMPLETE_AT_STOP
