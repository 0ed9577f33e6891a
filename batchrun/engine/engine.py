"""Engine: add_request / step / has_unfinished. A step: schedule, run and sample, update, then the sampled tokens
become forks, beam steps, stops and finished RequestOutputs. It knows nothing of files or tensors."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from batchrun.beam_search import BeamSearchParams
from batchrun.engine import beam as beam_search
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.contract import (
    GrammarState,
    PoolingRequest,
    PromptLogprobsRequest,
    SamplingRequest,
    ScheduledSeq,
    SchedulerOutput,
    StepExecutor,
    StepOutput,
)
from batchrun.engine.detokenizer import Detokenizer
from batchrun.engine.draft_policy import KeepRate
from batchrun.engine.metrics import EngineMetrics
from batchrun.engine.ngram import NgramDrafter
from batchrun.engine.pooling import PoolingState
from batchrun.engine.request import SeqStatus, Sequence, SequenceGroup
from batchrun.engine.results import request_output
from batchrun.engine.scheduler import Scheduler, SchedulerConfig
from batchrun.engine.stops import StopRule, banned_until_min_tokens, stop_decision, stop_rule
from batchrun.outputs import Logprob, RequestOutput
from batchrun.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1


def _decodes_only(s: ScheduledSeq) -> bool:
    """A decode token, with its drafts if any."""
    return len(s.token_ids) == 1 + s.num_draft


def _drafts_are_exact(params: SamplingParams) -> bool:
    """A draft row draws what decoding would: no penalty (it would see the drafts before it), no logprobs."""
    return (params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty
            and params.logprobs is None)


def fork_seed(request_seed: int, index: int) -> int:
    """The random stream of a request's sample `index` (0: the request's seed)."""
    return (request_seed + index * 0x9E3779B97F4A7C15) & _SEED_MASK


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 0
    num_host_blocks: int = 0
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    kv_bytes_per_token: int = 0  # for the metrics
    # the largest window when every layer has one, else None (BlockManager.release_outside_window)
    sliding_window: int | None = None


class Engine:
    def __init__(self, runner: StepExecutor, tokenizer, eos_token_ids: tuple[int, ...], config: EngineConfig,
                 scheduler_config: SchedulerConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          num_host_blocks=config.num_host_blocks,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          sliding_window=config.sliding_window)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.seqs: dict[int, Sequence] = {}
        self.groups: dict[int, SequenceGroup] = {}  # seq_id -> its group
        self._next_seq = 0
        self._arrivals = 0
        # beams that have their candidates, waiting for their siblings: seq_id -> (token ids, log-probs)
        self._beam_candidates: dict[int, tuple[list[int], list[float]]] = {}
        self.draft_keep = KeepRate()  # every sequence's drafts: where a new sequence's keep rate starts
        self._scoring: set[int] = set()  # seq ids of the groups whose prompt log-probabilities are being computed
        self._pooling: set[int] = set()  # seq ids of the pooled requests in flight
        self.metrics = EngineMetrics(kv_blocks_total=config.num_blocks,
                                     kv_host_blocks_total=config.num_host_blocks,
                                     kv_bytes_per_token=config.kv_bytes_per_token)

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    seed: int, beam: BeamSearchParams | None = None, grammar: GrammarState | None = None,
                    score_from: int = 1, pooling: PoolingState | None = None) -> None:
        """Queue a request. With n > 1 or beams, one sequence prefills and is forked when it first samples, so the
        prompt's blocks are computed once. `grammar`: a fresh structured-output matcher, forked per sample.
        `score_from`: with prompt_logprobs, the first prompt token scored (the blocks before may come from the
        prefix cache). `pooling`: the prompt is pooled (params must generate nothing: max_tokens 0)."""
        if grammar is not None and beam is not None:
            raise ValueError("structured outputs do not combine with beam search")
        seq = self._new_seq(list(prompt_ids), len(prompt_ids), seed, 0, params)
        seq.grammar = grammar
        width = beam.beam_width if beam else params.n
        if self.scheduler.config.num_speculative_tokens and width == 1 and beam is None and grammar is None and \
                _drafts_are_exact(params):
            banned = params.min_tokens > 0 and banned_until_min_tokens(params, self.eos_token_ids)
            seq.drafter = NgramDrafter(len(prompt_ids) + params.min_tokens if banned else 0, seq.stop_rule.max_len,
                                       self.scheduler.config.num_speculative_tokens, prior=self.draft_keep)
        group = SequenceGroup(request_id, self._arrivals, prompt, list(prompt_ids), params, [seq], seed=seed,
                              pending_forks=width - 1, beam=beam)
        if params.prompt_logprobs is not None:
            group.prompt_scores, group.score_from = [], max(1, score_from)
            if group.scoring_prompt:
                self._scoring.add(seq.seq_id)
        if pooling is not None:
            group.pooling = pooling
            self._pooling.add(seq.seq_id)
        self._arrivals += 1
        self.groups[seq.seq_id] = group
        self.scheduler.add(group)
        self.metrics.prompt_tokens += len(prompt_ids)

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        """A child sharing all of the parent's blocks, with the random stream of sample `index`."""
        child = self._new_seq(list(parent.token_ids), parent.prompt_len, fork_seed(group.seed, index), index,
                              group.params)
        child.status = SeqStatus.RUNNING
        child.num_computed = parent.num_computed
        child.cumulative_logprob = parent.cumulative_logprob
        if parent.grammar is not None:  # the same state so far; each then accepts its own tokens
            child.grammar = parent.grammar.fork()
        self.block_manager.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        self.groups[child.seq_id] = group
        return child

    def _new_seq(self, token_ids: list[int], prompt_len: int, seed: int, index: int,
                 params: SamplingParams) -> Sequence:
        seq = Sequence(self._next_seq, token_ids, prompt_len, seed, index)
        seq.detok = Detokenizer(self.tokenizer, token_ids[:prompt_len], params.skip_special_tokens,
                                params.stop, params.include_stop_str_in_output)
        seq.stop_rule = stop_rule(params, self.eos_token_ids, prompt_len, self.config.max_model_len)
        self._next_seq += 1
        self.seqs[seq.seq_id] = seq
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        model_before = self.runner.model_time_s
        out = self.scheduler.schedule()
        if out.is_empty and self.scheduler.has_unfinished():
            out = self.scheduler.schedule()  # a step that only preempted leaves the next one free to run
            if out.is_empty:
                raise RuntimeError("the scheduler made no progress: the KV cache cannot hold the running "
                                   "requests (a beam search wider than the cache?)")
        self._sync_scheduler_stats()
        if out.is_empty:
            return []
        sampling, verify, prompt_only = self._sampling_requests(out)
        scoring = self._prompt_logprob_requests(out) if self._scoring else []
        pooled = self._pooling_requests(out) if self._pooling else []
        t1 = time.perf_counter()
        result = self.runner.execute(out)
        t2 = time.perf_counter()
        self.scheduler.update(out, self.seqs)
        finished: list[RequestOutput] = []
        if scoring:
            self._apply_prompt_logprobs(scoring, result)
        for (group, chunk), request, vector in zip(pooled, out.pooling, result.pooled):
            group.pooling.add(request, vector, chunk, len(group.prompt_ids))
        for seq in prompt_only:
            self._finish_prompt_only(seq)
        if sampling or prompt_only:
            if sampling:
                self._apply(sampling, out.sampling, result, verify)
            for group in self.scheduler.drop_finished_groups():  # (none unless a sequence finished)
                finished.append(request_output(group, self.tokenizer))
                self.metrics.num_requests_finished += 1
                for s in group.seqs:
                    self.seqs.pop(s.seq_id, None)
                    self.groups.pop(s.seq_id, None)
        m = self.metrics
        m.schedule_time_s += t1 - t0
        m.outputs_time_s += time.perf_counter() - t2
        self._observe(t0, model_before, out)
        return finished

    def _sampling_requests(self, out: SchedulerOutput) -> tuple[list[Sequence], dict[int, ScheduledSeq],
                                                                list[Sequence]]:
        """Fill out.sampling (a plain row's request reused); the sampling sequences, the draft chunks by index, and
        the sequences whose prompt ends this step and that generate nothing (max_tokens 0): those sample no row."""
        seqs: list[Sequence] = []
        verify: dict[int, ScheduledSeq] = {}
        prompt_only: list[Sequence] = []
        requests = out.sampling
        by_id = self.seqs
        for s in out.seqs:
            if not s.sample:
                continue
            if s.num_draft:
                verify[len(seqs)] = s
            seq = by_id[s.seq_id]
            if seq.stop_rule.max_len <= seq.prompt_len:  # max_tokens 0
                s.sample = False
                prompt_only.append(seq)
                continue
            seqs.append(seq)
            req = seq.sampling
            if req is not None:
                n = len(seq.token_ids) - seq.prompt_len
                req.num_output = n
                if req.banned_token_ids and n >= req.params.min_tokens:
                    req.banned_token_ids = []
                requests.append(req)
            else:
                requests.append(self._new_sampling_request(seq))
        return seqs, verify, prompt_only

    def _finish_prompt_only(self, seq: Sequence) -> None:
        """A sequence whose prompt is computed and that generates nothing: n empty samples, ended by length."""
        self._pooling.discard(seq.seq_id)
        for member in self._fork_pending(self.groups[seq.seq_id], seq):
            member.finish_reason = "length"
            member.detok.finish([])
            self.scheduler.finish(member)

    def _fork_pending(self, group: SequenceGroup, seq: Sequence) -> list[Sequence]:
        """seq and the samples still to fork from it (an n > 1 request's first sample: n draws from one row)."""
        family = [seq] + [self._fork(group, seq, j) for j in range(1, group.pending_forks + 1)]
        group.pending_forks = 0
        return family

    def _prompt_logprob_requests(self, out: SchedulerOutput) -> list[SequenceGroup]:
        """Fill out.prompt_logprobs: each chunk of a group computing its prompt's log-probabilities scores the
        positions it holds that are not scored yet (a recomputed chunk scores nothing twice). Their groups."""
        groups = []
        for i, s in enumerate(out.seqs):
            if s.seq_id not in self._scoring:
                continue
            group = self.groups[s.seq_id]
            prompt = group.prompt_ids
            first = max(s.start, group.next_scored - 1)  # the row at position p scores prompt token p + 1
            end = min(s.start + len(s.token_ids), len(prompt) - 1)
            if first < end:
                out.prompt_logprobs.append(PromptLogprobsRequest(i, first - s.start, prompt[first + 1 : end + 1],
                                                                 group.params.prompt_logprobs))
                groups.append(group)
        return groups

    def _pooling_requests(self, out: SchedulerOutput) -> list[tuple[SequenceGroup, ScheduledSeq]]:
        """Fill out.pooling: the rows each chunk of a pooled request pools. Their groups and chunks, in order."""
        pooled = []
        for i, s in enumerate(out.seqs):
            if s.seq_id in self._pooling:
                group = self.groups[s.seq_id]
                request: PoolingRequest | None = group.pooling.request(i, s, len(group.prompt_ids))
                if request is not None:
                    out.pooling.append(request)
                    pooled.append((group, s))
        return pooled

    def _apply_prompt_logprobs(self, groups: list[SequenceGroup], result: StepOutput) -> None:
        for group, scores in zip(groups, result.prompt_logprobs):
            group.prompt_scores.extend(zip(scores.logprobs, scores.ranks, scores.top_token_ids, scores.top_logprobs))
            if not group.scoring_prompt:
                self._scoring.discard(group.seqs[0].seq_id)

    def _new_sampling_request(self, seq: Sequence) -> SamplingRequest:
        group = self.groups[seq.seq_id]
        p = group.params
        if group.beam is not None:
            return SamplingRequest(p, [seq.seed], seq.num_output, seq.token_ids, seq.prompt_len,
                                   num_beam_candidates=2 * group.beam.beam_width,
                                   beam_temperature=group.beam.temperature)
        seeds = [seq.seed]
        if group.pending_forks:  # the first sample of an n > 1 request: n draws from one logits row
            seeds += [fork_seed(group.seed, j) for j in range(1, group.pending_forks + 1)]
        # a constrained row is not banned its stop tokens: once its grammar is complete they may be all it
        # allows (and the grammar, not min_tokens, decides when it ends)
        banned = banned_until_min_tokens(p, self.eos_token_ids) \
            if seq.num_output < p.min_tokens and seq.grammar is None else []
        req = SamplingRequest(p, seeds, seq.num_output, seq.token_ids, seq.prompt_len, banned, grammar=seq.grammar)
        if len(seeds) == 1:  # a plain row from now on: reused by later steps
            seq.sampling = req
        return req

    def _apply(self, seqs: list[Sequence], requests: list[SamplingRequest], result: StepOutput,
               verify: dict[int, ScheduledSeq]) -> None:
        """The step's draws: fork first samples, append tokens, decide stops; beams once all have theirs. A plain
        row (one token, no logprobs, no grammar) takes the fast path, then keeps its confirmed drafts."""
        tokens, lps, ranks = result.token_ids, result.logprobs, result.ranks
        top_ids, top_lps = result.top_token_ids, result.top_logprobs
        row = beam_row = 0
        beam_groups: dict[str, SequenceGroup] = {}
        append_plain = self._append_plain
        plain = 0
        draft_at = 0  # next entry of result.draft_token_ids
        for i, (seq, req) in enumerate(zip(seqs, requests)):
            if len(req.seeds) == 1 and req.grammar is None and not req.num_beam_candidates and (
                    lps is None or req.params.logprobs is None):
                token = tokens[row]
                row += 1
                plain += 1
                ended = append_plain(seq, token)
                chunk = verify.get(i) if verify else None
                if chunk is not None:
                    if not ended:  # (a sequence that ended at its first token checks no draft)
                        plain += self._accept_drafts(seq, token, chunk, result.draft_token_ids, draft_at)
                    draft_at += chunk.num_draft
                continue
            group = self.groups[seq.seq_id]
            if req.num_beam_candidates:
                self._beam_candidates[seq.seq_id] = (result.beam_token_ids[beam_row], result.beam_logprobs[beam_row])
                beam_row += 1
                beam_groups.setdefault(group.request_id, group)
                continue
            for member in self._fork_pending(group, seq):  # its seeds: one per pending fork and itself
                top = (top_ids[row], top_lps[row]) if top_ids is not None else None
                logprob = Logprob(lps[row], ranks[row]) if lps is not None else None
                self._append(member, group.params, tokens[row], logprob, top)
                row += 1
        self.metrics.generation_tokens += plain
        for group in beam_groups.values():
            if all(s.seq_id in self._beam_candidates for s in group.live()):
                self._beam_step(group)

    def _append_plain(self, seq: Sequence, token: int) -> bool:
        """Append a plain row's token and apply its StopRule; True when that ends the sequence."""
        ids = seq.token_ids
        ids.append(token)
        rule: StopRule = seq.stop_rule
        length = len(ids)
        if length >= rule.min_len and token in rule.stop_reasons:  # EOS or a stop token
            seq.finish_reason, seq.stop_reason = "stop", rule.stop_reasons[token]
            seq.detok.finish(ids[seq.prompt_len : -1])  # the stop token is not text
            self.scheduler.finish(seq)
            return True
        detok = seq.detok
        if not detok.deferred:  # stop strings: the text is needed now
            hit = detok.add(token)
            if hit is not None and length >= rule.min_len:
                seq.finish_reason, seq.stop_reason = "stop", hit
                self.scheduler.finish(seq)
                return True
        if length >= rule.max_len:
            seq.finish_reason, seq.stop_reason = "length", None
            detok.finish(ids[seq.prompt_len :])
            self.scheduler.finish(seq)
            return True
        return False

    def _accept_drafts(self, seq: Sequence, token: int, chunk: ScheduledSeq, drawn: list[int], at: int) -> int:
        """Keep drafts while each equals the token drawn before it; each kept one appends the token drawn at its
        row, through the stop rule as decoding would. Returns how many tokens were appended."""
        drafts = chunk.token_ids[1:]
        kept = 0
        for j in range(chunk.num_draft):
            if drafts[j] != token:
                break
            kept += 1
            token = drawn[at + j]
            if self._append_plain(seq, token):
                break
        self.metrics.draft_tokens += chunk.num_draft
        self.metrics.accepted_draft_tokens += kept
        seq.drafter.record(chunk.num_draft, kept)
        if not seq.is_finished:
            self.scheduler.accept_drafts(seq, kept)
        return kept

    def _append(self, seq: Sequence, p: SamplingParams, token: int, logprob: Logprob | None,
                top: tuple[list[int], list[float]] | None) -> None:
        """Record a sampled token and decide the stop (the general path)."""
        seq.token_ids.append(token)
        self.metrics.generation_tokens += 1
        if logprob is not None and p.logprobs is not None:
            seq.cumulative_logprob += logprob
            entry = {t: Logprob(lp, rank) for rank, (t, lp) in enumerate(zip(top[0][: p.logprobs],
                                                                              top[1][: p.logprobs]), start=1)} \
                if top else {}
            entry[token] = logprob
            seq.logprobs.append(entry)
        ended = False
        if seq.grammar is not None:
            if not seq.grammar.accept_token(token):  # cannot happen when the mask was applied; never hidden
                log.warning("sequence %d: the grammar rejected token %d; stopping it", seq.seq_id, token)
                ended = True
            else:
                ended = seq.grammar.is_terminated()
        decision = stop_decision(seq, p, token, self.eos_token_ids, self.config.max_model_len, ended)
        if decision is not None:
            seq.finish_reason, seq.stop_reason = decision
            self.scheduler.finish(seq)

    # ---- beam search ---------------------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup) -> None:
        """Every live beam has its candidates: pick the next beams."""
        params: BeamSearchParams = group.beam
        beams = group.live()
        candidates = [self._beam_candidates.pop(b.seq_id) for b in beams]
        group.pending_forks = 0
        choices = beam_search.select(beams, candidates, params, self.eos_token_ids, group.hypotheses)
        by_parent: dict[int, list[beam_search.BeamChoice]] = {}
        for c in choices:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        live: list[Sequence] = []
        for b in beams:
            picked = by_parent.get(b.seq_id)
            if not picked:  # dropped: its blocks go back now
                self.scheduler.finish(b)
                continue
            for c in picked[1:]:
                child = self._fork(group, b, len(group.seqs))
                child.token_ids.append(c.token)
                child.cumulative_logprob = c.cum_logprob
                live.append(child)
            b.token_ids.append(picked[0].token)
            b.cumulative_logprob = picked[0].cum_logprob
            live.append(b)
        self.metrics.generation_tokens += len(choices)
        self._prune(group)
        if not live:
            return
        gen_len = live[0].num_output
        best = max(b.cumulative_logprob for b in live)
        at_limit = gen_len >= params.max_tokens or len(live[0].token_ids) >= self.config.max_model_len
        if at_limit or beam_search.is_done(group.hypotheses, best, gen_len, params):
            for b in live:
                if at_limit:
                    group.hypotheses.append(beam_search.Hypothesis(
                        list(b.token_ids), b.cumulative_logprob,
                        beam_search.score(b.cumulative_logprob, gen_len, params.length_penalty), "length"))
                self.scheduler.finish(b)
            self._prune(group)

    def _prune(self, group: SequenceGroup) -> None:
        """Forget a beam group's finished beams (its result is in its hypotheses)."""
        for s in group.seqs:
            if s.is_finished:
                self.seqs.pop(s.seq_id, None)
                self.groups.pop(s.seq_id, None)
        group.seqs = group.live()

    # ---- metrics -------------------------------------------------------------------------------------
    def _observe(self, t0: float, model_before: float, out: SchedulerOutput) -> None:
        m = self.metrics
        m.num_steps += 1
        live = running = 0
        status_running = SeqStatus.RUNNING
        for g in self.scheduler.running:
            for s in g.seqs:
                if s.status is status_running:
                    live += s.num_computed
                    running += 1
        m.observe_kv(live, self.block_manager.num_used, self.config.block_size, running)
        m.num_running = running
        dt = time.perf_counter() - t0
        if self.scheduler.config.num_speculative_tokens and all(map(_decodes_only, out.seqs)):
            # decode-only steps price a draft row (draft_policy.py); a prompt chunk's rows cost less each
            self.scheduler.step_costs.observe(out.num_tokens, dt)
        m.step_time_s += dt
        m.model_time_s = self.runner.model_time_s
        timers = getattr(self.runner, "timers", None)  # (a test's stand-in runner may have none)
        if timers is not None:
            m.forward_time_s, m.logits_time_s, m.sampling_time_s = timers.forward_s, timers.logits_s, timers.sampling_s
        m.engine_overhead_s += dt - (self.runner.model_time_s - model_before)

    def metrics_dict(self) -> dict[str, float | int]:
        """The metrics, with the waiting / swapped gauges counted now (O(queue): not every step)."""
        sch, m = self.scheduler, self.metrics
        m.num_waiting = sum(len(g.live()) for g in sch.waiting)
        m.num_swapped = sum(len(g.live()) for g in sch.swapped)
        return m.as_dict()

    def _sync_scheduler_stats(self) -> None:
        st, m = self.scheduler.stats, self.metrics
        m.num_preemptions_recompute = st.preempted_recompute
        m.num_preemptions_swap = st.preempted_swap
        m.blocks_swapped_out = st.swapped_out_blocks
        m.blocks_swapped_in = st.swapped_in_blocks
        m.prefix_cache_hit_tokens = st.prefix_hit_tokens

    # ---- lifecycle -----------------------------------------------------------------------------------
    def check_idle(self) -> None:
        bm = self.block_manager
        bm.check()
        assert bm.num_used == 0 and bm.num_host_used == 0, (bm.num_used, bm.num_host_used)

    def abort_all(self) -> None:
        """Drop every request in flight and give back their blocks (the prefix cache is kept)."""
        self._scoring.clear()
        self._pooling.clear()
        for group in self.scheduler.clear():
            for s in group.seqs:
                self.block_manager.free_seq(s.seq_id)
                self.seqs.pop(s.seq_id, None)
                self.groups.pop(s.seq_id, None)
        self._beam_candidates.clear()
