"""The step contract between the engine and the model runner: plain ints, floats and lists, one device-to-host
transfer per step. A leaf (standard library only), so the engine (no torch) and the runner share it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class SamplingOptions(Protocol):
    """What the runner reads of a request's SamplingParams (the request's own object: nothing is copied)."""

    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # 0 = off
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None  # top logprobs wanted per token; None = no logprobs at all


class GrammarState(Protocol):
    """A sequence's structured-output matcher (xgrammar's): the engine feeds and forks it, the runner masks with it."""

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...  # the grammar has ended (its stop token was accepted)

    def is_completed(self) -> bool: ...  # what was accepted so far is a complete match

    def fork(self) -> GrammarState: ...


@dataclass(slots=True)  # slots: compact, and quick to read in the per-sequence loops of a step
class ScheduledSeq:
    seq_id: int
    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0] (== tokens already in the cache)
    block_table: list[int]  # the live table (read-only for the runner)
    sample: bool  # this chunk reaches the end of the sequence: its last position yields logits
    # the last num_draft of token_ids are drafts (engine/ngram.py), not yet the sequence's; each draft row answers
    # the token the sequence draws at its position (the argmax, or that position's seeded draw)
    num_draft: int = 0


@dataclass(slots=True)
class SamplingRequest:
    """What to draw from one sampling row: a token per seed (several: the first sample of an n > 1 request), or
    for a beam row its top candidates. The engine updates a plain row's request in place across steps (as the
    scheduler does a ScheduledSeq): the runner reads both during `execute` only and keeps no reference."""

    params: SamplingOptions
    seeds: list[int]  # one per token to draw (the counter-based RNG's stream of each sample)
    num_output: int  # output tokens so far: the RNG counter, the position of the token being drawn
    token_ids: list[int]  # the sequence's tokens, prompt then output (read for penalties only)
    prompt_len: int
    banned_token_ids: list[int] = field(default_factory=list)  # may not be drawn yet (min_tokens: stops, EOS)
    num_beam_candidates: int = 0  # beam row: this many best (token, log-prob) of log_softmax(logits / T)
    beam_temperature: float = 0.0  # T of a beam row (0 = none)
    # only the tokens this matcher allows may be drawn (None: any); an n > 1 first sample draws all from it
    grammar: GrammarState | None = None

    @property
    def is_beam(self) -> bool:
        return self.num_beam_candidates > 0


@dataclass(slots=True)
class PromptLogprobsRequest:
    """Score prompt tokens in one scheduled chunk: the rows from `first_row` on of `seqs[seq_index]`'s chunk, row j
    predicting `target_ids[j]` (the prompt token after it)."""

    seq_index: int
    first_row: int
    target_ids: list[int]
    num_top: int  # the most likely tokens wanted at each row, besides the target


@dataclass
class PromptLogprobs:
    """One PromptLogprobsRequest's answer: per row, the target's log-probability and rank (1: the most likely),
    and the num_top most likely (token, log-prob), best first."""

    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(slots=True)
class PoolingRequest:
    """Pool hidden states of one scheduled chunk: `num_rows` rows from `first_row` on of `seqs[seq_index]`'s chunk
    (the final norm's output, as transformers' last_hidden_state), reduced by `reduce`: "row" the one row at
    first_row (last-token or CLS pooling), "mean" their mean, "sum" their sum (a mean over several chunks: the
    engine adds and divides). `head`: the model's classification head applied to the reduced vector (only where
    the whole pooled span is in this chunk)."""

    seq_index: int
    first_row: int
    num_rows: int
    reduce: str  # "row" | "mean" | "sum"
    head: bool = False


@dataclass
class SchedulerOutput:
    """All the runner is told for one step."""

    seqs: list[ScheduledSeq]  # one-token (decode) sequences first, then those with drafts, then prefill chunks
    num_decodes: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) device blocks
    # one per sequence with sample=True, in the order of `seqs` (filled by the engine before the step runs)
    sampling: list[SamplingRequest] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)  # (filled by the engine too)
    pooling: list[PoolingRequest] = field(default_factory=list)  # (filled by the engine too)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in and not self.copies


@dataclass
class StepOutput:
    """What one step sampled: tokens flat over the plain requests in order (len(seeds) each), a list per beam row."""

    token_ids: list[int] = field(default_factory=list)
    # the raw log-probability of each drawn token and its rank; None unless some request asked for logprobs
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    # the top max(logprobs) (token, log-prob) of each drawn token's row; None when nobody asked for any
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # beam rows: best candidates by log-prob after temperature and log_softmax, best first
    beam_token_ids: list[list[int]] = field(default_factory=list)
    beam_logprobs: list[list[float]] = field(default_factory=list)
    # the token drawn at each draft row: flat over the sampling sequences with num_draft > 0, in order
    draft_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # one per request, in order
    pooled: list[list[float]] = field(default_factory=list)  # one vector per PoolingRequest, in order


@dataclass
class RunnerTimers:
    """Seconds the runner has spent so far in each part of its steps."""

    forward_s: float = 0.0  # the model's layers
    logits_s: float = 0.0  # the lm_head on the sampling rows (and the scored prompt rows)
    sampling_s: float = 0.0  # the sampling tensors, the draws, the host transfer


class StepExecutor(Protocol):
    """What the engine needs of the model runner (batchrun.model.runner.model_runner.ModelRunner)."""

    model_time_s: float  # seconds spent in forwards so far (for the engine-overhead metric)
    timers: RunnerTimers

    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Apply the block moves, run the forward, sample; one host sync."""
        ...
