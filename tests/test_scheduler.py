"""Scheduler + block manager under random admit / decode / fork / preempt / finish, without a model.

A fake engine samples random tokens; the state machine checks after every step that the block accounting
holds, that every scheduled sequence has blocks covering what it will write, that queues agree with
statuses, and that everything drains to zero blocks in use. A fake runner keeps a simulated KV memory (the
token each slot holds): it applies the step's swaps and copies, writes every scheduled token, and only then
checks that each scheduled sequence reads back its own tokens through its block table, the order every
attention backend follows. That catches a prefix block shared before anyone computes it in the step.
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
        self.mem = {b: [None] * BS for b in range(num_blocks)}
        self.host = {h: [None] * BS for h in range(num_host)}
        self.prefixes = [[self.rng.randrange(3) for _ in range(24)] for _ in range(2)]

    def add(self, prompt_len, n, max_out, prefix=()):
        prompt = list(prefix) + [self.rng.randrange(3) for _ in range(prompt_len)]
        seq = Sequence(self.next_id, prompt, len(prompt), 0)
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
        self.run_forward(out)
        self.sched.update(out, self.seqs)
        assert not self.bm.pending  # the step ran: everything published ahead of it is confirmed
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

    def run_forward(self, out):
        """The runner's order: swap out, swap in, copy on write, store every token of the step, attend."""
        for dev, host in out.swap_out:
            self.host[host] = list(self.mem[dev])
        for host, dev in out.swap_in:
            self.mem[dev] = list(self.host[host])
        for src, dst in out.copies:
            self.mem[dst] = list(self.mem[src])
        for s in out.seqs:
            for j, tok in enumerate(s.token_ids):
                p = s.start + j
                self.mem[s.block_table[p // BS]][p % BS] = tok
        for s in out.seqs:
            end = s.start + len(s.token_ids)
            got = [self.mem[s.block_table[p // BS]][p % BS] for p in range(end)]
            assert got == self.seqs[s.seq_id].token_ids[:end], f"seq {s.seq_id} attends to the wrong K/V"


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

    @rule(count=st.integers(2, 5), which=st.integers(0, 1), prefix_len=st.integers(1, 24),
          suffix_len=st.integers(0, 6), n=st.integers(1, 2), max_out=st.integers(1, 8))
    def admit_sharing(self, count, which, prefix_len, suffix_len, n, max_out):
        """Requests that arrive together and share a prefix (admitted in one step when the budget allows)."""
        if n > self.e.sched.config.max_num_seqs:
            n = 1
        for _ in range(count):
            self.e.add(suffix_len, n, max_out, prefix=self.e.prefixes[which][:prefix_len])

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
        assert not bm.pending
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


def test_a_group_swapped_out_after_a_copy_on_write_in_the_same_step_keeps_its_kv():
    """Found by the machine above: a 3-sample group whose last block is shared gets a copy-on-write for one
    sample, then cannot grow and is swapped out in the same step; the runner swaps out before it copies, so the
    copy's block went to host memory unwritten and the sample read garbage after swap-in."""
    m = SchedulerMachine()
    m.setup(num_blocks=17, num_host=40, mode="swap", max_seqs=8, max_tokens=17, caching=False)
    for prompt_len, n, max_out in [(1, 3, 5), (1, 1, 1), (1, 1, 1), (1, 1, 1), (5, 1, 5), (1, 1, 1), (1, 1, 1),
                                   (1, 1, 1), (1, 1, 1), (25, 3, 2)]:
        m.admit(prompt_len=prompt_len, n=n, max_out=max_out)
        m.consistent()
    m.teardown()  # drains: every step's reads are checked against the simulated KV memory
    assert m.e.sched.stats.preempted_swap > 0
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


def _sharing_engine(max_tokens, caching=True, mode="recompute", num_blocks=64, num_host=0):
    e = FakeEngine(num_blocks=num_blocks, num_host=num_host, mode=mode, max_seqs=8, max_tokens=max_tokens,
                   caching=caching)
    prefix = [e.rng.randrange(3) for _ in range(5 * BS)]
    for _ in range(4):
        e.add(3, 1, 4, prefix=prefix)
    return e


def test_requests_admitted_together_compute_their_common_prefix_once():
    e = _sharing_engine(max_tokens=64)
    out = e.step()
    assert len(out.seqs) == 4  # all admitted in the first step
    assert out.num_tokens == 5 * BS + 4 * 3  # the prefix once, then each one's own suffix
    assert e.sched.stats.prefix_hit_tokens == 3 * 5 * BS
    first = e.bm.block_table(out.seqs[0].seq_id)[:5]
    assert all(e.bm.block_table(s.seq_id)[:5] == first for s in out.seqs)
    while e.sched.has_unfinished():
        e.step()
    assert e.bm.num_used == 0


def test_without_prefix_caching_nothing_is_shared_in_the_step():
    e = _sharing_engine(max_tokens=128, caching=False)
    out = e.step()
    assert out.num_tokens == 4 * (5 * BS + 3) and e.sched.stats.prefix_hit_tokens == 0
    assert not e.bm.cached


def test_a_prefix_chunked_over_two_steps_is_shared_in_the_step_that_finishes_it():
    """A budget of 14 tokens: the first request's prompt (23 tokens) takes two steps. Its second chunk fills
    the rest of the prefix in the step where the others are admitted: they map all five blocks."""
    e = _sharing_engine(max_tokens=14)
    first = e.step()
    assert [len(s.token_ids) for s in first.seqs] == [14]
    second = e.step()
    assert second.seqs[0].start == 14 and len(second.seqs) > 1
    assert all(s.start == 5 * BS for s in second.seqs[1:])  # the later ones start after the whole prefix
    assert e.sched.stats.prefix_hit_tokens == (len(second.seqs) - 1) * 5 * BS
    while e.sched.has_unfinished():
        e.step()
    assert e.sched.stats.prefix_hit_tokens == 3 * 5 * BS
    assert e.bm.num_used == 0


def test_sharers_preempted_after_sharing_stay_correct():
    """Shared prefix blocks, then too little memory: swap and recompute preemptions of the sharers (and of
    the group that computed the prefix); the fake runner checks every read."""
    for mode, host in (("recompute", 0), ("swap", 40)):
        e = _sharing_engine(max_tokens=64, mode=mode, num_blocks=14, num_host=host)
        for _ in range(4):
            e.add(5, 2, 10, prefix=e.prefixes[0][:10])
        while e.sched.has_unfinished():
            e.step()
        st_ = e.sched.stats
        assert st_.prefix_hit_tokens > 0
        assert (st_.preempted_swap if mode == "swap" else st_.preempted_recompute) > 0
        assert e.bm.num_used == 0 and e.bm.num_host_used == 0
