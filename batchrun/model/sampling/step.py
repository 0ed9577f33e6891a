"""One step's sampling: the engine's SamplingRequests -> tensors -> the sampler -> a StepOutput of lists.

The sampling tensors are built before the forward is queued (plan_sampling); after it, everything the step
returns (drawn tokens, their logprobs and top logprobs, beam candidates) is packed into one tensor and moved
to the host with one `.tolist()`: the only device sync of the step (sample_step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import torch

from batchrun.engine.contract import SamplingRequest, StepOutput
from batchrun.model.sampling.sampler import SamplingBatch, argmax_rows, sample

_params_of = attrgetter("params")


def build_sampling_batch(rows: list[SamplingRequest], seeds: list[int] | None, vocab: int, device: torch.device,
                         banned: tuple[list[int], list[int]] | None = None,
                         counters: list[int] | None = None) -> SamplingBatch:
    """Per-row parameters as tensors; row i draws with seeds[i] from the request rows[i] (a request drawing
    several samples appears once per seed; None: each row's one seed). `banned`: (row, token id) pairs that
    may not be drawn (None: from the rows' banned_token_ids). `counters`: each row's output position (None: the
    request's num_output; a draft row draws for a later position). What
    holds for the whole step is decided on the distinct parameter objects (a job's rows usually share one),
    so a greedy step costs one pass over the rows; O(tokens) only for rows with penalties."""
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
    banned_rows, banned_ids = _banned_pairs(rows) if banned is None else banned
    if banned_rows:
        b.banned = (torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev))
    asked = [p.logprobs for p in distinct if p.logprobs is not None]
    b.want_logprobs = bool(asked)
    b.max_logprobs = max(asked, default=0)
    return b


def _beam_candidates(logits: torch.Tensor, beams: list[SamplingRequest]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top max(num_beam_candidates) of log_softmax(logits / T) per beam row: (log-probs, ids) [rows, k]."""
    k = min(max(r.num_beam_candidates for r in beams), logits.shape[-1])
    temps = {r.beam_temperature for r in beams}
    if len(temps) == 1:  # the usual case: one expression for all rows
        t = temps.pop()
        logp = (logits / t if t > 0 else logits).log_softmax(dim=-1)
    else:
        logp = torch.cat([(row / r.beam_temperature if r.beam_temperature > 0 else row).log_softmax(dim=-1)
                          for row, r in zip(logits.split(1), beams)])
    return logp.topk(k, dim=-1)


@dataclass
class SamplingPlan:
    """A step's sampling as tensors, built before the forward is queued: on CUDA the small host-to-device
    copies then go ahead of the forward instead of waiting behind it."""

    rows: torch.Tensor | None  # logits row of each drawn sample; None: every row draws once, in order
    batch: SamplingBatch | None  # None: nothing to draw (beam rows only)
    num_drawn: int
    beam_rows: torch.Tensor | None
    beams: list[SamplingRequest]
    # structured outputs: the logits rows to mask and their matchers (empty: no row is constrained)
    grammar_rows: list[int] = field(default_factory=list)
    grammars: list = field(default_factory=list)
    # the draft rows' sampling when some drafting row samples (None: every draft row takes its argmax)
    drafts: SamplingBatch | None = None


def plan_draft_sampling(requests: list[SamplingRequest], num_drafts: list[int], vocab: int,
                        device: torch.device) -> SamplingBatch | None:
    """The draft rows of a step (num_drafts[i] of them after request i's row, in order) drawn as their request
    would draw at those positions: row j of request i draws output position num_output + 1 + j with the
    request's seed, which is the token decoding would give there once the drafts before it are kept. None when
    every drafting request is greedy (the argmax needs no parameters)."""
    rows: list[SamplingRequest] = []
    counters: list[int] = []
    for r, k in zip(requests, num_drafts):
        if k:
            rows += [r] * k
            counters += range(r.num_output + 1, r.num_output + 1 + k)
    if all(r.params.temperature == 0.0 for r in rows):
        return None
    return build_sampling_batch(rows, [r.seeds[0] for r in rows], vocab, device, ([], []), counters)


_grammar_of = attrgetter("grammar")
_beam_candidates_of = attrgetter("num_beam_candidates")
_banned_of = attrgetter("banned_token_ids")
_seeds_of = attrgetter("seeds")


def plan_sampling(requests: list[SamplingRequest], vocab: int, device: torch.device,
                  num_drafts: list[int] | None = None) -> SamplingPlan:
    """requests[i] samples from logits row i; num_drafts[i] draft rows follow the requests' rows (None: no
    drafts this step). The common step (every row a plain, unconstrained one-draw row) is recognised with a
    few C-level passes and keeps the requests themselves as the drawn rows; otherwise one Python pass sorts
    the rows out."""
    n = len(requests)
    drafts = plan_draft_sampling(requests, num_drafts, vocab, device) if num_drafts else None
    if (n and not any(map(_beam_candidates_of, requests)) and set(map(len, map(_seeds_of, requests))) == {1}
            and list(map(_grammar_of, requests)).count(None) == n):
        banned = _banned_pairs(requests) if any(map(_banned_of, requests)) else ([], [])
        return SamplingPlan(rows=None, batch=build_sampling_batch(requests, None, vocab, device, banned),
                            num_drawn=n, beam_rows=None, beams=[], drafts=drafts)
    drawn: list[SamplingRequest] = []
    seeds: list[int] = []
    rows: list[int] = []  # logits row of each drawn sample, when some row draws other than once
    beam_rows: list[int] = []
    beams: list[SamplingRequest] = []
    grammar_rows: list[int] = []
    grammars: list = []
    banned_rows: list[int] = []  # (drawn row, token id) pairs that may not be drawn yet
    banned_ids: list[int] = []
    plain = True  # so far every request draws exactly once
    for i, r in enumerate(requests):
        if r.grammar is not None:
            grammar_rows.append(i)
            grammars.append(r.grammar)
        if r.num_beam_candidates:
            if plain:
                rows, plain = list(range(i)), False
            beam_rows.append(i)
            beams.append(r)
            continue
        if r.banned_token_ids:
            for j in range(len(drawn), len(drawn) + len(r.seeds)):
                banned_rows += [j] * len(r.banned_token_ids)
                banned_ids += r.banned_token_ids
        if len(r.seeds) == 1:
            if not plain:
                rows.append(i)
            drawn.append(r)
            seeds.append(r.seeds[0])
        else:
            if plain:
                rows, plain = list(range(i)), False
            rows += [i] * len(r.seeds)
            drawn += [r] * len(r.seeds)
            seeds += r.seeds
    return SamplingPlan(
        rows=None if plain else torch.tensor(rows, device=device),
        batch=build_sampling_batch(drawn, seeds, vocab, device, (banned_rows, banned_ids)) if drawn else None,
        num_drawn=len(drawn),
        beam_rows=torch.tensor(beam_rows, device=device) if beams else None,
        beams=beams,
        grammar_rows=grammar_rows,
        grammars=grammars,
        drafts=drafts,
    )


def _banned_pairs(drawn: list[SamplingRequest]) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    ids: list[int] = []
    for i, r in enumerate(drawn):
        if r.banned_token_ids:
            rows += [i] * len(r.banned_token_ids)
            ids += r.banned_token_ids
    return rows, ids


def sample_step(logits: torch.Tensor, plan: SamplingPlan, drafts: torch.Tensor | None = None) -> StepOutput:
    """logits: float32 [requests, V] -> the step's draws and beam candidates, with one host transfer.
    drafts: float32 [draft rows, V], the logits of the draft rows (speculative decoding): the token each row
    gives at its position (plan.drafts; the argmax where every drafting row is greedy) comes back as
    draft_token_ids."""
    parts: list[torch.Tensor] = []  # everything returned, flattened, for one transfer
    result = None
    draft_ids = None
    if drafts is not None:
        draft_ids = argmax_rows(drafts) if plan.drafts is None else sample(drafts, plan.drafts).tokens
    if plan.batch is not None:
        result = sample(logits if plan.rows is None else logits[plan.rows], plan.batch)
        if result.logprob is None and not plan.beams:  # the common case: the tokens are all there is
            if draft_ids is None:
                return StepOutput(token_ids=result.tokens.tolist())
            n = result.tokens.shape[0]
            flat_ids = torch.cat([result.tokens, draft_ids]).tolist()
            return StepOutput(token_ids=flat_ids[:n], draft_token_ids=flat_ids[n:])
        parts.append(result.tokens)
        if result.logprob is not None:
            parts.append(result.logprob)
        if result.top_ids is not None:
            parts += [result.top_ids.flatten(), result.top_logprobs.flatten()]
    if plan.beams:
        beam_lp, beam_ids = _beam_candidates(logits[plan.beam_rows], plan.beams)
        parts += [beam_ids.flatten(), beam_lp.flatten()]
    if draft_ids is not None:
        parts.append(draft_ids)
    # float64 holds every token id and float32 log-prob exactly
    flat = torch.cat([p.to(torch.float64) for p in parts]).tolist()  # the one host sync of the step
    out = StepOutput()
    at = 0

    def take(n: int) -> list[float]:
        nonlocal at
        at += n
        return flat[at - n : at]

    if result is not None:
        n = plan.num_drawn
        out.token_ids = list(map(int, take(n)))
        if result.logprob is not None:
            out.logprobs = take(n)
        if result.top_ids is not None:
            k = result.top_ids.shape[1]
            ids, lps = list(map(int, take(n * k))), take(n * k)
            out.top_token_ids = [ids[j : j + k] for j in range(0, n * k, k)]
            out.top_logprobs = [lps[j : j + k] for j in range(0, n * k, k)]
    if plan.beams:
        k = beam_ids.shape[1]
        ids, lps = list(map(int, take(len(plan.beams) * k))), take(len(plan.beams) * k)
        for j, r in enumerate(plan.beams):
            width = min(r.num_beam_candidates, k)
            out.beam_token_ids.append(ids[j * k : j * k + width])
            out.beam_logprobs.append(lps[j * k : j * k + width])
    if draft_ids is not None:
        out.draft_token_ids = list(map(int, take(draft_ids.shape[0])))
    return out
