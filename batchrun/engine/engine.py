"""Engine: add_request / step / has_unfinished. One step = schedule, run the model, sample, update.

The engine knows nothing of files. It owns the request state (sequences, detokenizers, stop checks)
and turns the scheduler's plan and the sampler's tokens into finished RequestOutputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from batchrun.beam_search import BeamSearchParams
from batchrun.engine import beam as beam_search
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.detokenizer import Detokenizer
from batchrun.engine.metrics import EngineMetrics
from batchrun.engine.request import SeqStatus, Sequence, SequenceGroup
from batchrun.engine.sampler import SamplingBatch, sample
from batchrun.engine.scheduler import Scheduler, SchedulerConfig
from batchrun.model.runner import ModelRunner
from batchrun.outputs import CompletionOutput, RequestOutput
from batchrun.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 0
    num_host_blocks: int = 0
    max_model_len: int = 2048
    enable_prefix_caching: bool = True


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, eos_token_ids: tuple[int, ...], config: EngineConfig,
                 scheduler_config: SchedulerConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          num_host_blocks=config.num_host_blocks,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.seqs: dict[int, Sequence] = {}
        self.groups: dict[int, SequenceGroup] = {}  # seq_id -> its group
        self._next_seq = 0
        self._arrivals = 0
        self._beam_logp: dict[int, torch.Tensor] = {}  # beams that sampled, waiting for their siblings
        self.metrics = EngineMetrics(kv_blocks_total=config.num_blocks,
                                     kv_host_blocks_total=config.num_host_blocks,
                                     kv_bytes_per_token=runner.shape.bytes_per_token)
        self.device = runner.device

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    seed: int, beam: BeamSearchParams | None = None) -> None:
        """Queue a request. With n > 1 (or a beam search) one sequence prefills the prompt and is
        forked when it first samples, so the prompt's blocks are computed and stored once."""
        seq = self._new_seq(list(prompt_ids), len(prompt_ids), seed, 0, params)
        width = beam.beam_width if beam else params.n
        group = SequenceGroup(request_id, self._arrivals, prompt, list(prompt_ids), params, [seq], seed=seed,
                              pending_forks=width - 1, beam=beam)
        self._arrivals += 1
        self.groups[seq.seq_id] = group
        self.scheduler.add(group)
        self.metrics.prompt_tokens += len(prompt_ids)

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        """A child sharing all of the parent's blocks; its random stream is the request's, offset by index."""
        seed = (group.seed + index * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)
        child = self._new_seq(list(parent.token_ids), parent.prompt_len, seed, index, group.params)
        child.status = SeqStatus.RUNNING
        child.num_computed = parent.num_computed
        child.cumulative_logprob = parent.cumulative_logprob
        self.block_manager.fork(parent.seq_id, child.seq_id)
        group.seqs.append(child)
        self.groups[child.seq_id] = group
        return child

    def _new_seq(self, token_ids: list[int], prompt_len: int, seed: int, index: int,
                 params: SamplingParams) -> Sequence:
        seq = Sequence(self._next_seq, token_ids, prompt_len, seed, index)
        seq.detok = Detokenizer(self.tokenizer, token_ids[:prompt_len], params.skip_special_tokens,
                                params.stop, params.include_stop_str_in_output)
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
        logits = self.runner.execute(out)
        self.scheduler.after_step(out, self.seqs)
        sampling = [self.seqs[s.seq_id] for s in out.seqs if s.sample]
        finished: list[RequestOutput] = []
        if sampling:
            self._sample(sampling, logits)
            for group in self.scheduler.drop_finished_groups():
                finished.append(self._output(group))
                for s in group.seqs:
                    self.seqs.pop(s.seq_id, None)
                    self.groups.pop(s.seq_id, None)
        m = self.metrics
        m.num_steps += 1
        sch = self.scheduler
        live = running = 0
        for g in sch.running:
            for s in g.seqs:
                if s.status is SeqStatus.RUNNING:
                    live += s.num_computed
                    running += 1
        m.observe_kv(live, self.block_manager.num_used, self.config.block_size, running)
        m.num_running = running
        dt = time.perf_counter() - t0
        m.step_time_s += dt
        m.model_time_s = self.runner.model_time_s
        m.engine_overhead_s += dt - (self.runner.model_time_s - model_before)
        return finished

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor) -> None:
        rows: list[int] = []
        seqs: list[Sequence] = []
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}
        for i, seq in enumerate(sampling):
            group = self.groups[seq.seq_id]
            if group.beam is not None:
                beam_rows.setdefault(group.request_id, []).append((seq, i))
                continue
            family = [seq]
            if group.pending_forks:  # first sample of an n > 1 request: n children, one logits row
                family += [self._fork(group, seq, j) for j in range(1, group.pending_forks + 1)]
                group.pending_forks = 0
            rows += [i] * len(family)
            seqs += family
        if seqs:
            lg = logits if len(rows) == len(sampling) and not beam_rows else logits[torch.tensor(rows, device=logits.device)]
            result = sample(lg, self._sampling_batch(seqs, logits.shape[-1]))
            tokens = result.tokens.tolist()  # the one host sync of the step
            lp = result.logprob.tolist() if result.logprob is not None else None
            top_ids = result.top_ids.tolist() if result.top_ids is not None else None
            top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
            for i, seq in enumerate(seqs):
                self._append(seq, tokens[i], lp[i] if lp else None, (top_ids[i], top_lp[i]) if top_ids else None)
        for members in beam_rows.values():
            group = self.groups[members[0][0].seq_id]
            t = group.beam.temperature
            idx = torch.tensor([i for _, i in members], device=logits.device)
            logp = (logits[idx] / t if t > 0 else logits[idx]).log_softmax(dim=-1)
            for (seq, _), row in zip(members, logp):
                self._beam_logp[seq.seq_id] = row
            if all(s.seq_id in self._beam_logp for s in group.live()):
                self._beam_step(group)

    def _beam_step(self, group: SequenceGroup) -> None:
        """Every live beam has its next-token log-probs: pick the next beams (engine/beam.py)."""
        params: BeamSearchParams = group.beam
        beams = group.live()
        logp = torch.stack([self._beam_logp.pop(b.seq_id) for b in beams])
        group.pending_forks = 0
        choices = beam_search.select(beams, logp, params, self.eos_token_ids, group.hypotheses)
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
                        beam_search._score(b.cumulative_logprob, gen_len, params.length_penalty), "length"))
                self.scheduler.finish(b)
            self._prune(group)

    def _prune(self, group: SequenceGroup) -> None:
        """Forget a beam group's finished beams: its result lives in its hypotheses."""
        for s in group.seqs:
            if s.is_finished:
                self.seqs.pop(s.seq_id, None)
                self.groups.pop(s.seq_id, None)
        group.seqs = group.live()

    def metrics_dict(self) -> dict[str, float | int]:
        """The metrics, with the waiting / swapped gauges counted now (O(queue), so not every step)."""
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

    def _sampling_batch(self, seqs: list[Sequence], vocab: int) -> SamplingBatch:
        """Per-row parameters as tensors. O(rows) Python, plus O(tokens) only for rows with penalties."""
        dev = self.device
        params = [self.groups[s.seq_id].params for s in seqs]
        greedy = [p.temperature == 0.0 for p in params]
        all_greedy = all(greedy)
        b = SamplingBatch(
            greedy=torch.tensor(greedy, device=dev),
            temperature=torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=dev),
            top_k=torch.tensor([p.top_k for p in params], device=dev) if any(p.top_k for p in params) else None,
            top_p=torch.tensor([p.top_p for p in params], device=dev) if any(p.top_p < 1 for p in params) else None,
            min_p=torch.tensor([p.min_p for p in params], device=dev) if any(p.min_p > 0 for p in params) else None,
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev),
            counters=torch.tensor([s.num_output for s in seqs], dtype=torch.int64, device=dev),
            all_greedy=all_greedy,
        )
        if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
            b.repetition = torch.tensor([p.repetition_penalty for p in params], device=dev)
            b.presence = torch.tensor([p.presence_penalty for p in params], device=dev)
            b.frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
            b.prompt_mask = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=dev)
            b.output_counts = torch.zeros(len(seqs), vocab, device=dev)
            for i, s in enumerate(seqs):
                b.prompt_mask[i, torch.tensor(s.token_ids[: s.prompt_len], device=dev)] = True
                if s.num_output:
                    out = torch.tensor(s.output_ids, device=dev)
                    b.output_counts[i].index_add_(0, out, torch.ones(len(out), device=dev))
        rows, ids = [], []
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.num_output < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                rows += [i] * len(stops)
                ids += stops
        if rows:
            b.banned = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev))
        asked = [p.logprobs for p in params if p.logprobs is not None]
        b.want_logprobs = bool(asked)
        b.max_logprobs = max(asked, default=0)
        return b

    def _append(self, seq: Sequence, token: int, logprob: float | None, top: tuple | None) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        group = self.groups[seq.seq_id]
        p = group.params
        seq.token_ids.append(token)
        self.metrics.generation_tokens += 1
        if logprob is not None and p.logprobs is not None:
            seq.cumulative_logprob += logprob
            entry = dict(zip(top[0][: p.logprobs], top[1][: p.logprobs])) if top else {}
            entry[token] = logprob
            seq.logprobs.append(entry)
        n = seq.num_output
        reason = stop_reason = None
        can_stop = n >= p.min_tokens
        if can_stop and not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif can_stop and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        else:
            hit = seq.detok.add(token)
            if hit is not None and can_stop:
                reason, stop_reason = "stop", hit
        if reason is None and (n >= (p.max_tokens or self.config.max_model_len)
                               or len(seq.token_ids) >= self.config.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)

    def _output(self, group: SequenceGroup) -> RequestOutput:
        self.metrics.num_requests_finished += 1
        p = group.params
        if group.beam is not None:
            best = sorted(group.hypotheses, key=lambda h: h.score, reverse=True)[: group.beam.beam_width]
            outs = [CompletionOutput(index=i, text=self.tokenizer.decode(h.tokens[len(group.prompt_ids):],
                                                                          skip_special_tokens=True),
                                     token_ids=h.tokens[len(group.prompt_ids):], cumulative_logprob=h.cum_logprob,
                                     logprobs=None, finish_reason=h.finish_reason)
                    for i, h in enumerate(best)]
            return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished=True)
        outs = [
            CompletionOutput(
                index=s.index, text=s.detok.text, token_ids=s.output_ids,
                cumulative_logprob=s.cumulative_logprob if p.logprobs is not None else None,
                logprobs=s.logprobs if p.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            )
            for s in sorted(group.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, outs, finished=True)

    def check_idle(self) -> None:
        """No block in use in either pool once every request is done (a test and debugging aid)."""
        bm = self.block_manager
        bm.check()
        assert bm.num_used == 0 and bm.num_host_used == 0, (bm.num_used, bm.num_host_used)

    def abort_all(self) -> None:
        """Drop every request in flight and give back their blocks (the prefix cache is kept)."""
        sch = self.scheduler
        for group in [*sch.waiting, *sch.running, *sch.swapped]:
            for s in group.seqs:
                self.block_manager.free_seq(s.seq_id)
                self.seqs.pop(s.seq_id, None)
                self.groups.pop(s.seq_id, None)
        self._beam_logp.clear()
        sch.waiting.clear()
        sch.running.clear()
        sch.swapped.clear()
