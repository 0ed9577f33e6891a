"""Scheduler + block manager under random admit / decode / fork / preempt / finish, without a model.

A fake engine samples random tokens; the state machine checks after every step that the block accounting
holds, that every scheduled sequence has blocks covering what it will write, that queues agree with
statuses, and that everything drains to zero blocks in use.
"""

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from batchrun.engine.block_manager import BlockManager
from batchrun.engine.request import SeqStatus, Sequence, SequenceGroup
from batchrun.engine.scheduler import Scheduler, SchedulerConfig
from batchrun.sampling_params import SamplingParams

BS = 4


class FakeEngine:
    def __init__(self, num_blocks, num_host, mode, max_seqs, max_tokens, caching):
        self.bm = BlockManager(num_blocks, BS, num_host_blocks=num_host, enable_prefix_caching=caching)
        cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, preemption_mode=mode,
                              flops_per_token=1e6, bytes_per_block=1e3)
        self.sched = Scheduler(cfg, self.bm)
        self.seqs: dict[int, Sequence] = {}
        self.group_of: dict[int, SequenceGroup] = {}
        self.next_id = 0
        self.arrivals = 0
        self.rng = random.Random(0)
        self.max_len = num_blocks * BS

    def add(self, prompt_len, n, max_out):
        seq = Sequence(self.next_id, [self.rng.randrange(3) for _ in range(prompt_len)], prompt_len, 0)
        self.next_id += 1
        g = SequenceGroup(str(self.arrivals), self.arrivals, None, seq.token_ids[:], SamplingParams(n=n, max_tokens=max_out),
                          [seq], pending_forks=n - 1)
        self.arrivals += 1
        self.seqs[seq.seq_id] = seq
        self.group_of[seq.seq_id] = g
        self.sched.add(g)

    def step(self):
        out = self.sched.schedule()
        for s in out.seqs:  # every write lands in a block the sequence owns
            table = self.bm.block_table(s.seq_id)
            assert len(table) * BS >= s.start + len(s.token_ids)
        assert [len(s.token_ids) == 1 for s in out.seqs] == sorted((len(s.token_ids) == 1 for s in out.seqs), reverse=True)
        self.sched.update(out, self.seqs)
        for s in out.seqs:
            if not s.sample:
                continue
            seq = self.seqs[s.seq_id]
            g = self.group_of[seq.seq_id]
            family = [seq]
            if g.pending_forks:
                for j in range(g.pending_forks):
                    child = Sequence(self.next_id, list(seq.token_ids), seq.prompt_len, 0, j + 1,
                                     status=SeqStatus.RUNNING, num_computed=seq.num_computed)
                    self.next_id += 1
                    self.bm.fork(seq.seq_id, child.seq_id)
                    g.seqs.append(child)
                    self.seqs[child.seq_id] = child
                    self.group_of[child.seq_id] = g
                    family.append(child)
                g.pending_forks = 0
            for member in family:
                member.token_ids.append(self.rng.randrange(3))
                if member.num_output >= g.params.max_tokens or len(member.token_ids) >= self.max_len:
                    self.sched.finish(member)
        for g in self.sched.drop_finished_groups():
            for s in g.seqs:
                del self.seqs[s.seq_id]
        return out


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(8, 40), num_host=st.sampled_from([0, 6, 40]),
                mode=st.sampled_from(["swap", "recompute", "auto"]), max_seqs=st.integers(1, 8),
                max_tokens=st.integers(8, 40), caching=st.booleans())
    def setup(self, num_blocks, num_host, mode, max_seqs, max_tokens, caching):
        self.e = FakeEngine(num_blocks, num_host, mode, max_seqs, max_tokens, caching)
        self.e.preemptions_seen = 0

    @rule(prompt_len=st.integers(1, 30), n=st.integers(1, 3), max_out=st.integers(1, 12))
    def admit(self, prompt_len, n, max_out):
        if n > self.e.sched.config.max_num_seqs:
            n = 1
        self.e.add(prompt_len, n, max_out)

    @rule(steps=st.integers(1, 5))
    def run_steps(self, steps):
        for _ in range(steps):
            if self.e.sched.has_unfinished():
                self.e.step()

    @invariant()
    def consistent(self):
        if not hasattr(self, "e"):
            return
        bm, sch = self.e.bm, self.e.sched
        bm.check()
        assert bm.num_free + bm.num_used == bm.num_blocks
        for g in sch.waiting:
            for s in g.live():
                assert s.status is SeqStatus.WAITING and not bm.is_resident(s.seq_id) and s.num_computed == 0
        for g in sch.swapped:
            for s in g.live():
                assert (s.status is SeqStatus.SWAPPED and bm.is_swapped(s.seq_id)) or (
                    s.status is SeqStatus.WAITING and not bm.is_resident(s.seq_id))
        for g in sch.running:
            for s in g.live():  # a running group may hold a sibling back for recompute
                if s.status is SeqStatus.RUNNING:
                    assert bm.is_resident(s.seq_id) and len(bm.block_table(s.seq_id)) * BS >= s.num_computed
                else:
                    assert s.status is SeqStatus.WAITING and not bm.is_resident(s.seq_id)
        assert sch.num_running_seqs() <= sch.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "e"):
            return
        for _ in range(5000):
            if not self.e.sched.has_unfinished():
                break
            self.e.step()
        assert not self.e.sched.has_unfinished(), "did not drain"
        self.e.bm.check()
        assert self.e.bm.num_used == 0 and self.e.bm.num_host_used == 0


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=120, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_preemption_happens_and_drains():
    e = FakeEngine(num_blocks=10, num_host=20, mode="swap", max_seqs=8, max_tokens=64, caching=True)
    for i in range(8):
        e.add(6 + i, 1 + i % 2, 10)
    while e.sched.has_unfinished():
        e.step()
    st_ = e.sched.stats
    assert st_.preempted_swap > 0 and st_.swapped_in_blocks == st_.swapped_out_blocks
    assert e.bm.num_used == 0


def test_chunked_prefill_respects_the_token_budget():
    e = FakeEngine(num_blocks=64, num_host=0, mode="recompute", max_seqs=4, max_tokens=10, caching=False)
    e.add(37, 1, 3)
    e.add(5, 1, 3)
    while e.sched.has_unfinished():
        out = e.step()
        assert out.num_tokens <= 10


def test_a_group_swapped_before_its_forks_counts_them_when_it_comes_back():
    """Found by the state machine: an n=2 group swapped out while prefilling still owes one fork, and
    swapping it back in must count it against max_num_seqs (it ran 4 sequences with max_num_seqs=3)."""
    machine = SchedulerMachine()
    machine.setup(num_blocks=8, num_host=6, mode="swap", max_seqs=3, max_tokens=9, caching=False)
    for _ in range(5):
        machine.admit(max_out=1, n=1, prompt_len=1)
    machine.admit(max_out=3, n=1, prompt_len=15)
    for steps, admit in ((3, dict(max_out=2, n=2, prompt_len=13)), (2, dict(max_out=2, n=2, prompt_len=1)),
                         (1, None)):
        machine.run_steps(steps=steps)
        machine.consistent()
        if admit:
            machine.admit(**admit)
            machine.consistent()
    machine.teardown()
