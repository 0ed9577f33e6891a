"""One beam-search step for a group, scored as transformers' beam search. A beam chosen twice is forked, one
not chosen finishes at once. The top 2 x width candidates by cumulative log-prob (summed in float32, as the model
computes them) choose: an EOS among the top `width` becomes a hypothesis scored cum / gen_len ** length_penalty,
the rest refill the beams. Each beam's own top 2 x width suffice: the overall top 2 x width are among them."""

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
    """The next beams; EOS candidates go to `hypotheses`. candidates[i]: beam i's best 2 x width (ids, log-probs)."""
    width = params.beam_width
    keys: list[tuple[int, int]] = []  # (beam, token) of each candidate
    sums: list[float] = []
    for b, (beam, (ids, logps)) in enumerate(zip(beams, candidates)):
        cum = beam.cumulative_logprob
        for token, lp in zip(ids, logps):
            keys.append((b, token))
            sums.append(cum + lp)
    scores = array("f", sums).tolist()  # each sum rounded to float32, as a float32 top-k would see it
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
    """transformers' early_stopping=False: beam_width hypotheses in, and the best live beam cannot beat their worst."""
    if len(hypotheses) < params.beam_width:
        return False
    worst = sorted(h.score for h in hypotheses)[-params.beam_width]
    return worst >= score(live_best_cum, gen_len, params.length_penalty)
