"""One beam-search step for one group: keep the best `beam_width` continuations of all live beams.

The beams are sequences of one group in the engine, sharing KV blocks by reference: a beam chosen
twice is forked (its blocks shared, copied on write when the copies diverge), a beam not chosen is
finished at once so its blocks go back. Scoring follows transformers' beam search: the flattened top
2 x width candidates by cumulative log-probability; a candidate ending in EOS among the top `width`
becomes a finished hypothesis scored cum_logprob / generated_len ** length_penalty; the rest refill the
beams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _score(cum: float, gen_len: int, length_penalty: float) -> float:
    return cum / (max(gen_len, 1) ** length_penalty)


def select(beams: list[Sequence], logprobs: torch.Tensor, params: BeamSearchParams, eos: tuple[int, ...],
           hypotheses: list[Hypothesis]) -> list[BeamChoice]:
    """Choose the next beams; EOS candidates go to `hypotheses`. logprobs: [len(beams), V]."""
    width = params.beam_width
    cum = torch.tensor([b.cumulative_logprob for b in beams], dtype=logprobs.dtype, device=logprobs.device)
    scores = (cum[:, None] + logprobs).flatten()
    k = min(2 * width, scores.numel())
    top_scores, top_idx = scores.topk(k)
    vocab = logprobs.shape[1]
    choices: list[BeamChoice] = []
    for rank, (s, i) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
        parent, token = beams[i // vocab], i % vocab
        if not params.ignore_eos and token in eos:
            if rank < width:
                gen = parent.num_output + 1
                hypotheses.append(Hypothesis(parent.token_ids + [token], s, _score(s, gen, params.length_penalty),
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
    return worst >= _score(live_best_cum, gen_len, params.length_penalty)
