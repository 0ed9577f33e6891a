"""Prompt log-probabilities: the scored rows' logits a chunk of rows at a time (never a [prompt, vocab] matrix of more
than CHUNK_ROWS rows), each reduced at once to its target's log-probability and rank and the most likely tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.contract import PromptLogprobsRequest
from batchrun.model.sampling.sampler import score_rows

CHUNK_ROWS = 256


@dataclass
class PromptScores:
    logprobs: torch.Tensor  # float32 [rows]
    ranks: torch.Tensor  # int64 [rows]
    top_ids: torch.Tensor | None  # int64 [rows, num_top]
    top_logprobs: torch.Tensor | None  # float32 [rows, num_top]


def score_prompts(compute_logits, hidden: torch.Tensor, requests: list[PromptLogprobsRequest],
                  chunk_starts: list[int]) -> list[PromptScores]:
    """compute_logits: the model's hidden rows -> fp32 logits (CausalLM.compute_logits); hidden: the step's hidden
    states, a chunk's rows from chunk_starts[seq_index] on."""
    scores = []
    for r in requests:
        first = chunk_starts[r.seq_index] + r.first_row
        targets = torch.tensor(r.target_ids, device=hidden.device)
        parts = []
        for at in range(0, len(r.target_ids), CHUNK_ROWS):
            rows = hidden[first + at : first + min(at + CHUNK_ROWS, len(r.target_ids))]
            parts.append(score_rows(compute_logits(rows), targets[at : at + rows.shape[0]], r.num_top))
        logprob, rank, top_lp, top_ids = (torch.cat(x) if x[0] is not None else None for x in zip(*parts))
        scores.append(PromptScores(logprob, rank, top_ids, top_lp))
    return scores
