"""The step contract: what the scheduler and engine tell the model runner, and what the runner gives back.

This module is a leaf: it imports nothing of batchrun (only the standard library), so the engine (no torch)
and the model runner (torch) both depend on it and on nothing of each other. Everything in it is plain
ints, floats and lists; the runner turns them into tensors, runs the model, samples, and answers with one
`StepOutput` made from a single device-to-host transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class SamplingOptions(Protocol):
    """What the runner reads of a request's sampling parameters (batchrun.sampling_params.SamplingParams
    has these fields). A Protocol rather than the class itself keeps this module a leaf, and the engine
    passes the request's own object: nothing is copied per step."""

    temperature: float  # 0 = greedy
    top_p: float
    top_k: int  # 0 = off
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None  # top logprobs wanted per token; None = no logprobs at all


class GrammarState(Protocol):
    """A sequence's structured-output matcher (an xgrammar GrammarMatcher, made by batchrun.structured).
    It lives on the engine's Sequence; the engine feeds it the drawn tokens and forks it with the sequence,
    the runner fills the step's token bitmask from it. Opaque here, so neither side imports the other."""

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
    # speculative decoding (engine/ngram.py): the last num_draft of token_ids are draft tokens, not yet the
    # sequence's. The row of token_ids[0] samples as usual; each draft row answers the token the sequence draws at
    # its position (the argmax, or the seeded draw of that output position).
    num_draft: int = 0


@dataclass(slots=True)
class SamplingRequest:
    """What to draw from the logits row of one sequence that samples this step.

    A plain row draws one token per seed: len(seeds) > 1 is the first sample of an n > 1 request, whose
    children are forked from this sequence after the step, all drawn from its one logits row. A beam row
    (num_beam_candidates > 0) draws nothing: the runner returns its top candidates instead.

    The engine keeps a plain row's request across steps and updates it in place (num_output, and
    banned_token_ids once min_tokens is reached); the scheduler does the same with a decoding sequence's
    ScheduledSeq. The runner reads both during `execute` only and keeps no reference to them.
    """

    params: SamplingOptions
    seeds: list[int]  # one per token to draw (the counter-based RNG's stream of each sample)
    num_output: int  # output tokens so far: the RNG counter, the position of the token being drawn
    token_ids: list[int]  # the sequence's tokens, prompt then output (read for penalties only)
    prompt_len: int
    banned_token_ids: list[int] = field(default_factory=list)  # may not be drawn yet (min_tokens: stops, EOS)
    num_beam_candidates: int = 0  # beam row: this many best (token, log-prob) of log_softmax(logits / T)
    beam_temperature: float = 0.0  # T of a beam row (0 = none)
    # structured outputs: only the tokens this matcher allows may be drawn (None: unconstrained). The
    # first sample of an n > 1 request draws all its samples from the one state, as they share the prefix.
    grammar: GrammarState | None = None

    @property
    def is_beam(self) -> bool:
        return self.num_beam_candidates > 0


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

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in and not self.copies


@dataclass
class StepOutput:
    """What one step sampled, as plain lists.

    Drawn tokens are flat over the plain sampling requests in order, len(seeds) entries each (beam rows
    take none); beam candidates are one list per beam row, in order.
    """

    token_ids: list[int] = field(default_factory=list)
    # the raw log-probability of each drawn token; None unless some request asked for logprobs
    logprobs: list[float] | None = None
    # the top max(logprobs) (token, log-prob) of each drawn token's row; None when nobody asked for any
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # beam rows: best candidates by log-prob after temperature and log_softmax, best first
    beam_token_ids: list[list[int]] = field(default_factory=list)
    beam_logprobs: list[list[float]] = field(default_factory=list)
    # the token drawn at each draft row: flat over the sampling sequences with num_draft > 0, in order
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class RunnerTimers:
    """Seconds the runner has spent so far in each part of its steps (the engine copies them into its metrics)."""

    forward_s: float = 0.0  # the model's layers
    logits_s: float = 0.0  # the lm_head on the sampling rows
    sampling_s: float = 0.0  # the sampling tensors, the draws, the host transfer


class StepExecutor(Protocol):
    """What the engine needs of the model runner (batchrun.model.runner.model_runner.ModelRunner)."""

    model_time_s: float  # seconds spent in forwards so far (for the engine-overhead metric)
    timers: RunnerTimers

    def execute(self, out: SchedulerOutput) -> StepOutput:
        """Apply the block moves, run the forward, sample; one host sync."""
        ...
