"""A step's sampling parameters as tensors: SamplingBatch, built from the engine's SamplingRequests."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch

from batchrun.engine.contract import SamplingRequest

_params_of = attrgetter("params")


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device."""

    # temperature, seeds and counters are None when every row is greedy (argmax needs none of them)
    temperature: torch.Tensor | None  # float32 [B]: 0 on greedy rows
    top_k: torch.Tensor | None  # int64 [B], 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # float32 [B], 1 = off
    min_p: torch.Tensor | None  # float32 [B], 0 = off
    seeds: torch.Tensor | None  # int64 [B]
    counters: torch.Tensor | None  # int64 [B]: output position of the token being drawn
    all_greedy: bool
    # penalties (None when no row uses any)
    repetition: torch.Tensor | None = None  # float [B]
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # bool [B, V]: token appears in the prompt
    output_counts: torch.Tensor | None = None  # float [B, V]: times the token appears in the output
    # rows that may not stop yet (min_tokens): (row indices, token ids to ban there)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    max_logprobs: int = 0  # the largest SamplingParams.logprobs among the rows (-1 = none asked)
    want_logprobs: bool = False



def build_sampling_batch(rows: list[SamplingRequest], seeds: list[int] | None, vocab: int, device: torch.device,
                         banned: tuple[list[int], list[int]] | None = None,
                         counters: list[int] | None = None) -> SamplingBatch:
    """Per-row parameters as tensors: row i draws with seeds[i] for rows[i] (None: each row's seed); `banned`,
    `counters`: (row, token) pairs and output positions (None: the rows'). What holds for the whole step is decided
    on the distinct parameter objects, so a greedy step is one pass over the rows."""
    dev = device
    params = list(map(_params_of, rows))
    distinct = list(dict(zip(map(id, params), params)).values())
    all_greedy = all(p.temperature == 0.0 for p in distinct)
    # a greedy step (a batch job's default) is an argmax: none of the draw's tensors are built for it
    drawing = not all_greedy
    if drawing and seeds is None:
        seeds = [r.seeds[0] for r in rows]
    b = SamplingBatch(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        if drawing else None,
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev)
        if any(p.top_k for p in distinct) else None,
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        if any(p.top_p < 1 for p in distinct) else None,
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        if any(p.min_p > 0 for p in distinct) else None,
        seeds=torch.tensor(seeds, dtype=torch.int64, device=dev) if drawing else None,
        counters=torch.tensor([r.num_output for r in rows] if counters is None else counters, dtype=torch.int64,
                              device=dev) if drawing else None,
        all_greedy=all_greedy,
    )
    if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in distinct):
        b.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
        b.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
        b.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
        b.prompt_mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
        b.output_counts = torch.zeros(len(rows), vocab, device=dev)
        for i, r in enumerate(rows):
            b.prompt_mask[i, torch.tensor(r.token_ids[: r.prompt_len], device=dev)] = True
            if r.num_output:
                out = torch.tensor(r.token_ids[r.prompt_len :], device=dev)
                b.output_counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
    banned_rows, banned_ids = banned_pairs(rows) if banned is None else banned
    if banned_rows:
        b.banned = (torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev))
    asked = [p.logprobs for p in distinct if p.logprobs is not None]
    b.want_logprobs = bool(asked)
    b.max_logprobs = max(asked, default=0)
    return b


def banned_pairs(drawn: list[SamplingRequest]) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    ids: list[int] = []
    for i, r in enumerate(drawn):
        if r.banned_token_ids:
            rows += [i] * len(r.banned_token_ids)
            ids += r.banned_token_ids
    return rows, ids
