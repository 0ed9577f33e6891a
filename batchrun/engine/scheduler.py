"""Continuous batching, first come first served, within the block manager's budget.

Each step: the running groups advance (a decode token or a prompt's next chunk), preempting the newest group when
blocks run out; swapped groups come back before anything new; waiting groups are admitted while blocks above the
watermark, `max_num_seqs` and the token budget allow. `update` then records what the step computed."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

from batchrun.engine.block_manager import BlockManager
from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
from batchrun.engine.draft_policy import StepCosts, choose_drafts
from batchrun.engine.request import SeqStatus, Sequence, SequenceGroup

log = logging.getLogger(__name__)

PREFIX_WINDOW = 32  # waiting groups looked at for prefix-cache hits, and the most times one may be passed over


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    preemption_mode: str = "auto"  # "recompute" | "swap" | "auto"
    # drafts per decoding sequence (0: none), while a step's decode rows and drafts fit speculative_max_rows
    num_speculative_tokens: int = 0
    speculative_max_rows: int = 128
    whole_prompts: bool = False  # a prompt is computed in one step or waits (an encoder: bidirectional attention)
    # the auto preemption cost model's rates (Scheduler._prefer_swap), filled in from the model and device
    flops_per_token: float = 0.0
    bytes_per_block: float = 0.0
    compute_flops_per_s: float = 1e11
    copy_bytes_per_s: float = 1e10
    swap_latency_s: float = 1e-4


@dataclass
class StepStats:
    preempted_recompute: int = 0
    preempted_swap: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    prefix_hit_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # in arrival order
        self.swapped: deque[SequenceGroup] = deque()
        self.stats = StepStats()
        self.step_costs = StepCosts()  # a step's seconds by its rows, observed by the engine (draft_policy.py)
        # sequences admitted with part of their prompt: their next chunks are published ahead too
        self._prefilling: dict[int, Sequence] = {}
        self._finished_since_drop = False  # a sequence finished since drop_finished_groups last looked
        self._mixed = False  # this step schedules some chunk that is not a single token

    # ---- queues ----------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        return sum(len(g.live()) + g.pending_forks for g in self.running)

    def finish(self, seq: Sequence) -> None:
        """A sequence ended: its blocks go back now (its full blocks stay cached)."""
        seq.status = SeqStatus.FINISHED
        self.bm.free_seq(seq.seq_id)
        self._finished_since_drop = True

    def clear(self) -> list[SequenceGroup]:
        """Empty every queue (an abort) and return the groups; the caller gives back their blocks."""
        groups = [*self.waiting, *self.running, *self.swapped]
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        return groups

    def drop_finished_groups(self) -> list[SequenceGroup]:
        """Take the finished groups out of the running queue (a no-op unless a sequence finished)."""
        if not self._finished_since_drop:
            return []
        self._finished_since_drop = False
        done: list[SequenceGroup] = []
        keep: list[SequenceGroup] = []
        for g in self.running:
            (done if g.is_finished else keep).append(g)
        if done:
            self.running = keep
        return done

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput(seqs=[], num_decodes=0)
        budget = [cfg.max_num_batched_tokens]
        preempted = False

        # 1. running groups, oldest first; the newest are the preemption victims. `held`: sequences staying.
        self._mixed = False  # (set by _schedule_group)
        running, decode_slot, seqs_out = self.running, self.bm.decode_slot, out.seqs
        status_running = SeqStatus.RUNNING
        held = 0
        # rows left for drafts; none while free blocks are few, so a draft never causes a preemption
        spare = cfg.speculative_max_rows - len(running) \
            if cfg.num_speculative_tokens and self.bm.num_free > 2 * len(running) else 0
        drafts = self._plan_drafts(spare) if spare > 0 else None
        i = 0
        while i < len(running):
            group = running[i]
            seqs = group.seqs
            if len(seqs) == 1 and budget[0] > 0:
                # decode fast path: what _schedule_group would make, with the ScheduledSeq reused
                seq = seqs[0]
                start = seq.num_computed
                tokens = seq.token_ids
                if len(tokens) - start == 1 and seq.status is status_running:
                    proposed = drafts.get(seq.seq_id) if drafts else None
                    if proposed and self._schedule_drafts(seq, proposed, out, budget):
                        held += 1
                        i += 1
                        continue
                    table = decode_slot(seq.seq_id, start)
                    if table is not None:
                        planned = seq.scheduled
                        if planned is None:
                            planned = seq.scheduled = ScheduledSeq(seq.seq_id, [tokens[start]], start, table, True)
                        else:
                            planned.token_ids = [tokens[start]]
                            planned.start = start
                            planned.block_table = table
                        seqs_out.append(planned)
                        budget[0] -= 1
                        held += 1 + group.pending_forks
                        i += 1
                        continue
            while not self._schedule_group(group, out, budget):
                if len(running) == 1 and self._preempt_sibling(group, out):
                    continue
                victim = running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is group:
                    break
            else:
                held += len(group.live()) + group.pending_forks
                i += 1
                continue
            break  # the group itself was preempted: it was the newest, nothing after it

        # 2. swapped groups come back before anything new is admitted
        if not preempted:
            while self.swapped and budget[0] > 0:
                group = self.swapped[0]
                ids = [s.seq_id for s in group.live() if self.bm.is_swapped(s.seq_id)]
                # a group swapped out before its first sample still owes its n - 1 forks: they count too
                wants = len(group.live()) + group.pending_forks
                if held + wants > cfg.max_num_seqs or not self.bm.can_swap_in(ids):
                    break
                self.swapped.popleft()
                pairs = self.bm.swap_in(ids)
                out.swap_in.extend(pairs)
                self.stats.swapped_in_blocks += len(pairs)
                for s in group.live():
                    if s.status is SeqStatus.SWAPPED:
                        s.status = SeqStatus.RUNNING
                self._insert_running(group)
                held += wants
                if not self._schedule_group(group, out, budget):
                    break  # stays running with nothing scheduled this step; it goes first next step

        # 3. admit new work. Nothing is preempted from here on, so this step's filled blocks are published
        # ahead: a group admitted below maps a common prefix an earlier group computes in this step.
        if not preempted and not self.swapped:
            if self._prefilling:
                self._publish_continuations(out)
            while self.waiting and budget[0] > 0:
                pick = self._pick_waiting()
                group = self.waiting[pick]
                wants = len(group.live()) + group.pending_forks
                if held + wants > cfg.max_num_seqs:
                    break
                first = len(out.seqs)
                self._schedule_group(group, out, budget)  # nothing resident yet: it cannot fail
                if not any(self.bm.is_resident(s.seq_id) for s in group.live()):
                    break  # no room: admitted later
                del self.waiting[pick]
                for g in itertools.islice(self.waiting, pick):
                    g.bypassed += 1
                self._insert_running(group)
                held += wants
                if self.bm.enable_prefix_caching:
                    self._publish_admitted(group, out.seqs[first:])

        if self._mixed:  # stable: decodes first, then draft checks, then prefill chunks, order kept
            out.seqs.sort(key=lambda s: 0 if len(s.token_ids) == 1 else 1 if s.num_draft else 2)
            out.num_decodes = sum(1 for s in out.seqs if len(s.token_ids) == 1)
        else:  # every chunk is one token: already in order
            out.num_decodes = len(out.seqs)
        return out

    def _schedule_group(self, group: SequenceGroup, out: SchedulerOutput, budget: list[int]) -> bool:
        """Schedule the group's next tokens. False (nothing scheduled) when a resident sequence cannot grow:
        the caller preempts and retries. A sequence without blocks that cannot get them waits."""
        planned: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        budget_before = budget[0]
        bm = self.bm
        for seq in group.seqs:
            if seq.status is SeqStatus.FINISHED:
                continue
            if budget[0] <= 0:
                break
            resident = bm.is_resident(seq.seq_id)
            prefix, keys = [], []
            if not resident:  # first allocation: reuse what the prefix cache holds
                limit = group.cache_limit
                prefix, keys = bm.lookup(seq.token_ids if limit is None else seq.token_ids[:limit])
                seq.num_computed = len(prefix) * bm.block_size
                if seq.num_output == 0 and not group.num_cached_tokens:
                    group.num_cached_tokens = seq.num_computed
            n = min(len(seq.token_ids) - seq.num_computed, budget[0])
            if n <= 0:  # e.g. a beam that has sampled and waits for its siblings
                continue
            if self.config.whole_prompts and n < len(seq.token_ids) - seq.num_computed:
                break  # not admitted: it waits for a step with room for all of it
            # the watermark keeps room for resident sequences to grow; it only matters if any exist
            pairs = bm.allocate(seq.seq_id, seq.num_computed + n, seq.num_computed, prefix=prefix,
                                prefix_keys=keys, admit=not resident and bm.num_used > 0)
            if pairs is None:
                if resident:
                    budget[0] = budget_before
                    out.copies.extend(copies)  # made for siblings whose tables already changed
                    return False
                seq.num_computed = 0
                continue
            if not resident:
                seq.status = SeqStatus.RUNNING
                self.stats.prefix_hit_tokens += len(prefix) * bm.block_size
            if pairs:
                copies.extend(pairs)
            start = seq.num_computed
            planned.append(ScheduledSeq(seq.seq_id, seq.token_ids[start : start + n], start,
                                        bm.block_table(seq.seq_id), start + n == len(seq.token_ids)))
            if n != 1:
                self._mixed = True
            budget[0] -= n
        out.seqs.extend(planned)
        out.copies.extend(copies)
        return True

    def _plan_drafts(self, spare: int) -> dict[int, list[int]]:
        """seq_id -> the drafts this step checks, within `spare` rows (draft_policy.choose_drafts decides)."""
        room = min(self.config.num_speculative_tokens, spare)
        proposals = []
        for group in self.running:
            if len(group.seqs) == 1:
                seq = group.seqs[0]
                if seq.drafter is not None and seq.status is SeqStatus.RUNNING and \
                        len(seq.token_ids) - seq.num_computed == 1:
                    drafts = seq.drafter.propose(seq.token_ids, room)
                    if drafts:
                        proposals.append((seq.seq_id, drafts, seq.drafter.keep.rate))
        if not proposals:
            return {}
        return choose_drafts(proposals, len(self.running), spare, self.step_costs)

    def _schedule_drafts(self, seq: Sequence, drafts: list[int], out: SchedulerOutput, budget: list[int]) -> bool:
        """Schedule a decode token with the drafts the budget fits; False (decode plainly) when none fit."""
        drafts = drafts[: budget[0] - 1]
        if not drafts:
            return False
        tokens, start = seq.token_ids, seq.num_computed
        n = 1 + len(drafts)
        pairs = self.bm.allocate(seq.seq_id, start + n, start)
        if pairs is None:
            return False
        out.copies.extend(pairs)
        out.seqs.append(ScheduledSeq(seq.seq_id, [tokens[start], *drafts], start, self.bm.block_table(seq.seq_id),
                                     True, len(drafts)))
        budget[0] -= n
        self._mixed = True
        return True

    def _preempt_sibling(self, group: SequenceGroup, out: SchedulerOutput) -> bool:
        """The only running group cannot grow: recompute one of its sequences later (it finishes a few at a time)."""
        resident = [s for s in group.live() if self.bm.is_resident(s.seq_id)]
        if len(resident) <= 1:
            return False
        seq = resident[-1]
        out.seqs[:] = [s for s in out.seqs if s.seq_id != seq.seq_id]
        self.bm.free_seq(seq.seq_id)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.stats.preempted_recompute += 1
        return True

    def _pick_waiting(self) -> int:
        """Among the first PREFIX_WINDOW waiting groups, the one with the most prompt blocks cached; a head fully
        cached is taken at once, and none is passed over more than PREFIX_WINDOW times."""
        head = self.waiting[0]
        if not self.bm.enable_prefix_caching or len(self.waiting) == 1 or head.bypassed >= PREFIX_WINDOW:
            return 0
        best, best_hits = 0, self._cached_blocks(head)
        if best_hits and best_hits == len(head.block_keys):
            return 0
        for i, g in enumerate(itertools.islice(self.waiting, 1, PREFIX_WINDOW), start=1):
            hits = self._cached_blocks(g)
            if hits > best_hits:
                best, best_hits = i, hits
        return best

    def _cached_blocks(self, group: SequenceGroup) -> int:
        if group.block_keys is None:  # computed once per request
            group.block_keys = self.bm.chain_keys(group.prompt_ids)
        return self.bm.num_cached_blocks(group.block_keys)

    def _publish_admitted(self, group: SequenceGroup, chunks: list[ScheduledSeq]) -> None:
        """Publish ahead the blocks the admitted group's chunks fill, for the groups admitted after it."""
        for chunk in chunks:
            seq = next(s for s in group.seqs if s.seq_id == chunk.seq_id)
            end = chunk.start + len(chunk.token_ids)
            self.bm.publish_ahead(seq.seq_id, seq.token_ids, end)
            if end < len(seq.token_ids):
                self._prefilling[seq.seq_id] = seq

    def _publish_continuations(self, out: SchedulerOutput) -> None:
        """Publish ahead this step's later chunks of partly admitted prompts; forget completed or evicted ones."""
        prefilling, bm = self._prefilling, self.bm
        for chunk in out.seqs:
            seq = prefilling.get(chunk.seq_id)
            if seq is None:
                continue
            end = chunk.start + len(chunk.token_ids)
            bm.publish_ahead(seq.seq_id, seq.token_ids, end)
            if end >= len(seq.token_ids):
                del prefilling[seq.seq_id]
        for seq_id in [i for i, seq in prefilling.items() if seq.is_finished or not bm.is_resident(i)]:
            del prefilling[seq_id]

    def _insert_running(self, group: SequenceGroup) -> None:
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival > group.arrival:
            i -= 1
        self.running.insert(i, group)

    # ---- preemption ------------------------------------------------------------------------------
    def _prefer_swap(self, group: SequenceGroup) -> bool:
        """Auto: swap when moving the blocks out and back costs less than a prefill; a forked group always swaps."""
        mode = self.config.preemption_mode
        if mode == "recompute" or self.bm.num_host_blocks == 0:
            return False
        if mode == "swap" or len(group.seqs) > 1:
            return True
        cfg = self.config
        tokens = sum(s.num_computed for s in group.live())
        blocks = self.bm.num_distinct_blocks([s.seq_id for s in group.live()])
        recompute_s = tokens * cfg.flops_per_token / cfg.compute_flops_per_s
        swap_s = cfg.swap_latency_s + 2 * blocks * cfg.bytes_per_block / cfg.copy_bytes_per_s
        return swap_s < recompute_s

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        live = group.live()
        ids = {s.seq_id for s in live}
        out.seqs[:] = [s for s in out.seqs if s.seq_id not in ids]  # forget what it had this step
        resident = [s.seq_id for s in live if self.bm.is_resident(s.seq_id)]
        # The runner swaps out before it copies: a block this step's copy-on-write fills is swapped out from
        # its source instead, and the copy dropped.
        copy_of = {dst: src for src, dst in out.copies} if out.copies else {}
        victim_blocks = {b for seq_id in resident for b in self.bm.block_table(seq_id)} if copy_of else set()
        if victim_blocks:
            out.copies[:] = [(src, dst) for src, dst in out.copies if dst not in victim_blocks]
        if self._prefer_swap(group) and self.bm.can_swap_out(resident):
            pairs = self.bm.swap_out(resident)
            if victim_blocks:
                pairs = [(copy_of.get(dev, dev), host) for dev, host in pairs]
            out.swap_out.extend(pairs)
            for s in live:
                if self.bm.is_swapped(s.seq_id):
                    s.status = SeqStatus.SWAPPED
            self.swapped.append(group)
            self.stats.preempted_swap += 1
            self.stats.swapped_out_blocks += len(pairs)
        else:
            for s in live:
                self.bm.free_seq(s.seq_id)
                s.num_computed = 0
                s.status = SeqStatus.WAITING
            self.waiting.appendleft(group)
            self.stats.preempted_recompute += 1
        log.debug("preempted %s (%d seqs)", group.request_id, len(live))

    # ---- after the step --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """The step ran: advance num_computed and publish the filled blocks, before the engine appends tokens."""
        commit = self.bm.commit
        bs = self.bm.block_size
        caching = self.bm.enable_prefix_caching
        windowed = self.bm.sliding_window is not None
        for s in out.seqs:
            seq = seqs[s.seq_id]
            num_tokens = len(s.token_ids) - s.num_draft  # drafts count once accepted (accept_drafts)
            seq.num_computed = computed = s.start + num_tokens
            # a decode token fills a block only at a block boundary; commit has nothing to do otherwise
            if caching and (num_tokens != 1 or computed % bs == 0):
                commit(seq.seq_id, seq.token_ids, computed)
            if windowed:  # blocks that fell out of every layer's window go back (block_manager.py)
                self.bm.release_outside_window(seq.seq_id, computed)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """The first num_accepted drafts' K/V are the sequence's now; blocks taken only for rejected ones go back."""
        if num_accepted:
            seq.num_computed += num_accepted
            if self.bm.enable_prefix_caching:
                self.bm.commit(seq.seq_id, seq.token_ids, seq.num_computed)
        self.bm.trim(seq.seq_id, seq.num_computed + 1)
