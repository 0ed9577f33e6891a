"""A step's pooled vectors: the hidden rows each PoolingRequest names, reduced, then the classifier where asked."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchrun.engine.contract import PoolingRequest


def pool_rows(hidden: torch.Tensor, requests: list[PoolingRequest], chunk_starts: list[int],
              head: Callable[[torch.Tensor], torch.Tensor] | None) -> list[torch.Tensor]:
    """hidden: the step's rows, chunk i's from chunk_starts[i] on. One float32 vector per request, on the device
    (the step's one host transfer takes them)."""
    vectors = []
    for r in requests:
        first = chunk_starts[r.seq_index] + r.first_row
        rows = hidden[first : first + r.num_rows].float()
        vector = rows[0] if r.reduce == "row" else rows.mean(0) if r.reduce == "mean" else rows.sum(0)
        if r.head:  # one row at a time: a row's logits do not depend on the step's other rows
            if head is None:
                raise ValueError("this model has no classification head")
            vector = head(vector[None].to(hidden.dtype))[0].float()
        vectors.append(vector)
    return vectors
