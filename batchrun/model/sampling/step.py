"""One step's sampling: SamplingRequests -> tensors (plan_sampling, before the forward is queued) -> the sampler ->
a StepOutput of lists, everything moved to the host in one `.tolist()`, the step's only device sync."""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import torch

from batchrun.engine.contract import PromptLogprobs, SamplingRequest, StepOutput
from batchrun.model.sampling.batch import SamplingBatch, banned_pairs, build_sampling_batch
from batchrun.model.sampling.prompt_logprobs import PromptScores
from batchrun.model.sampling.sampler import argmax_rows, sample


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
    """A step's sampling as tensors, built before the forward is queued (on CUDA its copies go ahead of it)."""

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

    @property
    def draws_only(self) -> bool:
        """Whether each request's answer is one token drawn in order with its temperature and filters alone: no
        penalties, bans, logprobs, grammars or beams, and greedy drafts."""
        b = self.batch
        return (self.rows is None and b is not None and not b.want_logprobs and b.repetition is None
                and b.banned is None and not self.grammars and not self.beams and self.drafts is None)

    @property
    def argmax_only(self) -> bool:
        """Whether every logits row's answer is its argmax alone: draws_only, every row greedy."""
        return self.draws_only and self.batch.all_greedy


def argmax_output(tokens: torch.Tensor | list[int], num_sampling: int) -> StepOutput:
    """The step's output when each logits row takes its argmax (SamplingPlan.argmax_only): the first num_sampling
    tokens are the requests' draws, the rest their draft rows', in one host transfer (none for a list)."""
    ids = tokens if isinstance(tokens, list) else tokens.tolist()
    if len(ids) == num_sampling:
        return StepOutput(token_ids=ids)
    return StepOutput(token_ids=ids[:num_sampling], draft_token_ids=ids[num_sampling:])


def plan_draft_sampling(requests: list[SamplingRequest], num_drafts: list[int], vocab: int,
                        device: torch.device) -> SamplingBatch | None:
    """The draft rows' sampling: row j after request i's draws position num_output + 1 + j with the request's
    seed, the token decoding would give there. None when every drafting request is greedy."""
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
    """requests[i] samples from logits row i, num_drafts[i] draft rows after all of them (None: no drafts). The
    common step, one plain draw per row, is recognised in a few C-level passes."""
    n = len(requests)
    drafts = plan_draft_sampling(requests, num_drafts, vocab, device) if num_drafts else None
    if (n and not any(map(_beam_candidates_of, requests)) and set(map(len, map(_seeds_of, requests))) == {1}
            and list(map(_grammar_of, requests)).count(None) == n):
        banned = banned_pairs(requests) if any(map(_banned_of, requests)) else ([], [])
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


def sample_step(logits: torch.Tensor | None, plan: SamplingPlan | None, drafts: torch.Tensor | None = None,
                prompt: list[PromptScores] | None = None, pooled: list[torch.Tensor] | None = None) -> StepOutput:
    """float32 logits [requests, V], and the draft rows' -> the step's draws, logprobs, beam candidates and draft
    tokens, the prompt rows' scores and the pooled vectors, in one host transfer."""
    parts: list[torch.Tensor] = []  # everything returned, flattened, for one transfer
    result = None
    draft_ids = None
    if drafts is not None:
        draft_ids = argmax_rows(drafts) if plan.drafts is None else sample(drafts, plan.drafts).tokens
    beams = plan.beams if plan is not None else []
    if plan is not None and plan.batch is not None:
        result = sample(logits if plan.rows is None else logits[plan.rows], plan.batch)
        if result.logprob is None and not beams and not prompt and not pooled:  # the common case: the tokens are all there is
            if draft_ids is None:
                return StepOutput(token_ids=result.tokens.tolist())
            n = result.tokens.shape[0]
            flat_ids = torch.cat([result.tokens, draft_ids]).tolist()
            return StepOutput(token_ids=flat_ids[:n], draft_token_ids=flat_ids[n:])
        parts.append(result.tokens)
        if result.logprob is not None:
            parts += [result.logprob, result.rank]
        if result.top_ids is not None:
            parts += [result.top_ids.flatten(), result.top_logprobs.flatten()]
    if beams:
        beam_lp, beam_ids = _beam_candidates(logits[plan.beam_rows], beams)
        parts += [beam_ids.flatten(), beam_lp.flatten()]
    if draft_ids is not None:
        parts.append(draft_ids)
    for scores in prompt or ():
        parts += [scores.logprobs, scores.ranks]
        if scores.top_ids is not None:
            parts += [scores.top_ids.flatten(), scores.top_logprobs.flatten()]
    parts += pooled or ()
    if not parts:
        return StepOutput()
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
            out.ranks = list(map(int, take(n)))
        if result.top_ids is not None:
            k = result.top_ids.shape[1]
            ids, lps = list(map(int, take(n * k))), take(n * k)
            out.top_token_ids = [ids[j : j + k] for j in range(0, n * k, k)]
            out.top_logprobs = [lps[j : j + k] for j in range(0, n * k, k)]
    if beams:
        k = beam_ids.shape[1]
        ids, lps = list(map(int, take(len(beams) * k))), take(len(beams) * k)
        for j, r in enumerate(beams):
            width = min(r.num_beam_candidates, k)
            out.beam_token_ids.append(ids[j * k : j * k + width])
            out.beam_logprobs.append(lps[j * k : j * k + width])
    if draft_ids is not None:
        out.draft_token_ids = list(map(int, take(draft_ids.shape[0])))
    for scores in prompt or ():
        n = scores.logprobs.shape[0]
        k = scores.top_ids.shape[1] if scores.top_ids is not None else 0
        lps, ranks = take(n), list(map(int, take(n)))
        ids, top = (list(map(int, take(n * k))), take(n * k)) if k else ([], [])
        out.prompt_logprobs.append(PromptLogprobs(lps, ranks, [ids[j : j + k] for j in range(0, n * k, k)] if k else
                                                  [[]] * n, [top[j : j + k] for j in range(0, n * k, k)] if k else [[]] * n))
    out.pooled = [take(v.shape[0]) for v in pooled or ()]
    return out
