"""Requests as the engine sees them: a group of sequences that share a prompt (n samples, beams)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchrun.outputs import Logprob
from batchrun.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)  # slots: compact, and quick to read in the per-sequence loops of a step
class Sequence:
    """One token stream. `num_computed` counts the tokens whose K/V are in the cache."""

    seq_id: int
    token_ids: list[int]  # prompt + generated
    prompt_len: int
    seed: int  # the random stream of this sequence (request seed, child index mixed in)
    index: int = 0  # sample index within its group
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: object | None = None  # the incremental detokenizer's state (engine/detokenizer.py)
    grammar: object | None = None  # structured outputs: its matcher (contract.GrammarState), fed each token
    # kept across steps so a decode step creates no per-sequence objects (vLLM v1's persistent batch idea):
    stop_rule: object | None = None  # its stop conditions (stops.StopRule), from its params at creation
    sampling: object | None = None  # the engine's SamplingRequest of a plain row, updated in place each step
    scheduled: object | None = None  # the scheduler's ScheduledSeq of its decode step, updated in place
    drafter: object | None = None  # speculative decoding: its ngram.NgramDrafter (greedy plain rows only)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(slots=True)
class SequenceGroup:
    """A request: the sequences sampled from one prompt. Scheduling and preemption act on whole groups."""

    request_id: str
    arrival: int  # FCFS order; a preempted group keeps its place
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    seed: int = 0
    # n > 1 and beams: the first sequence is forked when its prompt is done (see Engine._fork)
    pending_forks: int = 0
    beam: object | None = None  # BeamSearchParams for a beam-search request
    hypotheses: list = field(default_factory=list)  # finished beams (engine/beam.py Hypothesis)
    block_keys: list[int] | None = None  # prefix-cache keys of the prompt's full blocks (scheduler)
    bypassed: int = 0  # times a later request was admitted first (bounded: no starvation)
    # prompt_logprobs: (logprob, rank, top ids, top logprobs) of the prompt's tokens from score_from on, as far as
    # computed (None: not asked)
    prompt_scores: list[tuple[float, int, list[int], list[float]]] | None = None
    score_from: int = 1
    num_cached_tokens: int = 0  # prompt tokens its first allocation took from the prefix cache
    pooling: object | None = None  # a pooled request's pooling.PoolingState (it generates nothing)

    @property
    def next_scored(self) -> int:
        """The prompt token whose log-probability comes next (its row is the position before it)."""
        return self.score_from + len(self.prompt_scores)

    @property
    def scoring_prompt(self) -> bool:
        """Prompt log-probabilities are asked and not all computed: the prefix cache may give only the blocks
        before the next scored token's row, so every scored position is computed."""
        return self.prompt_scores is not None and self.next_scored < len(self.prompt_ids)

    @property
    def cache_limit(self) -> int | None:
        """The prompt tokens the prefix cache may give (None: all): scored and pooled rows must be computed."""
        limit = self.next_scored if self.scoring_prompt else None
        pooled = self.pooling.cache_limit if self.pooling is not None else None
        if pooled is not None:
            limit = pooled if limit is None else min(limit, pooled)
        return limit

    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status is not SeqStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        if self.pending_forks:
            return False
        for s in self.seqs:  # (a loop, not all(): asked of every running group when any sequence ends)
            if s.status is not SeqStatus.FINISHED:
                return False
        return True
