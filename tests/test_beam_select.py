"""engine/beam.py chooses from each beam's own top 2 x width what a top-k over the whole table would choose."""

import pytest
import torch

from batchrun.beam_search import BeamSearchParams
from batchrun.engine.beam import select
from batchrun.engine.request import Sequence


@pytest.mark.parametrize("width,vocab,seed", [(1, 50, 0), (3, 40, 1), (4, 300, 2), (6, 7, 3)])
def test_select_matches_a_flattened_topk(width, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    beams = [Sequence(i, [1, 2, 3, 4 + i], 3, 0) for i in range(width)]
    cum = (torch.randn(width, generator=g) * 3 - 5).float()
    for b, c in zip(beams, cum.tolist()):
        b.cumulative_logprob = c
    logp = (torch.randn(width, vocab, generator=g) * 2).log_softmax(-1)
    k = min(2 * width, vocab)
    top_lp, top_ids = logp.topk(k, dim=-1)
    candidates = list(zip(top_ids.tolist(), top_lp.tolist()))
    eos = (int(logp[0].argmax()),)  # the best continuation of beam 0 ends the hypothesis
    params = BeamSearchParams(beam_width=width, max_tokens=8)
    hypotheses = []
    choices = select(beams, candidates, params, eos, hypotheses)

    scores = (cum[:, None] + logp).flatten()  # the reference: float32, whole table
    ref_scores, ref_idx = scores.topk(min(2 * width, scores.numel()))
    ref_choices, ref_hyps = [], []
    for rank, (s, i) in enumerate(zip(ref_scores.tolist(), ref_idx.tolist())):
        beam, token = divmod(i, vocab)
        if token in eos:
            if rank < width:
                ref_hyps.append((beam, token, s))
            continue
        ref_choices.append((beam, token, s))
        if len(ref_choices) == width:
            break
    assert [(beams.index(c.parent), c.token, c.cum_logprob) for c in choices] == ref_choices
    assert [(h.tokens[-2] - 4, h.tokens[-1], h.cum_logprob) for h in hypotheses] == ref_hyps
