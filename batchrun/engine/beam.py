"""One beam-search step for one group: keep the best `beam_width` continuations of all live beams.

The beams are sequences of one group in the engine, sharing KV blocks by reference: a beam chosen
twice is forked (its blocks shared, copied on write when the copies diverge), a beam not chosen is
finished at once so its blocks go back. Scoring follows transformers' beam search: the flattened top
2 x width candidates by cumulative log-probability; a candidate ending in EOS among the top `width`
becomes a finished hypothesis scored cum_logprob / generated_len ** length_penalty; the rest refill the
beams.

The runner returns each beam's own top 2 x width (token, log-prob); the flattened top 2 x width over all
beams is always among those (a candidate beaten by 2 x width others of its own beam is beaten by them
overall), so choosing from them is exact. Scores are summed in float32, as the model computes them, so the
choice matches a float32 top-k over the whole [beams, vocab] table.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from batchrun.beam_search import BeamSearchParams
from batchrun.engine.request import Sequence


@dataclass
class Hypothesis:
    tokens: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamChoice:
    parent: Sequence
    token: int
    cum_logprob: float


def score(cum: float, gen_len: int, length_penalty: float) -> float:
    return cum / (max(gen_len, 1) ** length_penalty)


def select(beams: list[Sequence], candidates: list[tuple[list[int], list[float]]], params: BeamSearchParams,
           eos: tuple[int, ...], hypotheses: list[Hypothesis]) -> list[BeamChoice]:
    """Choose the next beams; EOS candidates go to `hypotheses`. candidates[i]: beam i's best (token ids,
    log-probs), at least 2 x width of them (or the whole vocabulary)."""
    width = params.beam_width
    keys: list[tuple[int, int]] = []  # (beam, token) of each candidate
    sums: list[float] = []
    for b, (beam, (ids, logps)) in enumerate(zip(beams, candidates)):
        cum = beam.cumulative_logprob
        for token, lp in zip(ids, logps):
            keys.append((b, token))
            sums.append(cum + lp)
    scores = array("f", sums).tolist()  # float32 rounding of each sum (exact: see the module docstring)
    # best first; ties to the lower (beam, token), as a top-k over the flattened table would order them
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], keys[i]))[: 2 * width]
    choices: list[BeamChoice] = []
    for rank, i in enumerate(order):
        s = scores[i]
        b, token = keys[i]
        parent = beams[b]
        if not params.ignore_eos and token in eos:
            if rank < width:
                gen = parent.num_output + 1
                hypotheses.append(Hypothesis(parent.token_ids + [token], s, score(s, gen, params.length_penalty),
                                             "stop"))
            continue
        choices.append(BeamChoice(parent, token, s))
        if len(choices) == width:
            break
    return choices


def is_done(hypotheses: list[Hypothesis], live_best_cum: float, gen_len: int, params: BeamSearchParams) -> bool:
    """transformers' default (early_stopping=False) test: stop once beam_width hypotheses are in and the
    best live beam, scored at its current length, cannot beat the worst of the kept ones."""
    if len(hypotheses) < params.beam_width:
        return False
    worst = sorted(h.score for h in hypotheses)[-params.beam_width]
    return worst >= score(live_best_cum, gen_len, params.length_penalty)
