"""Block manager: random operation sequences against a simulated KV memory.

Besides the accounting invariants (free + used == total, ref counts == holders, nothing leaks), the test
keeps a fake memory of what token each physical slot holds, applies the copy-on-write and swap pairs the
manager returns, and checks after every operation that every sequence reads back exactly its own tokens
through its block table. That catches a shared block written without a copy, a stale prefix-cache hit, or
a swap that loses a block. With a sliding window, blocks wholly before a sequence's next window are released
after each write (as the scheduler does after each step), and every position inside the window must still read
back its token.
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchrun.engine.block_manager import HOLE, BlockManager

BS = 4


class BlockMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), num_host=st.integers(0, 16), caching=st.booleans(),
                window=st.one_of(st.none(), st.integers(1, 10)))
    def setup(self, num_blocks, num_host, caching, window):
        self.bm = BlockManager(num_blocks, BS, num_host_blocks=num_host, enable_prefix_caching=caching,
                               watermark=0.0, sliding_window=window)
        self.window = window
        self.mem = {b: [None] * BS for b in range(num_blocks)}
        self.host = {h: [None] * BS for h in range(num_host)}
        self.tokens: dict[int, list[int]] = {}  # seq -> its tokens
        self.computed: dict[int, int] = {}  # seq -> tokens written to the cache
        self.swapped: set[int] = set()
        self.next_id = 0

    def _write(self, seq, start, end):
        table = self.bm.block_table(seq)
        for p in range(start, end):
            self.mem[table[p // BS]][p % BS] = self.tokens[seq][p]

    def _copy(self, pairs):
        for src, dst in pairs:
            self.mem[dst] = list(self.mem[src])

    def _grow(self, seq, new_tokens):
        """Append tokens to a resident sequence: allocate, copy on write, write, publish."""
        start = self.computed[seq]
        self.tokens[seq] = self.tokens[seq][:start] + new_tokens
        pairs = self.bm.allocate(seq, start + len(new_tokens), start)
        if pairs is None:
            self.tokens[seq] = self.tokens[seq][:start]
            return
        self._copy(pairs)
        self._write(seq, start, start + len(new_tokens))
        self.computed[seq] = start + len(new_tokens)
        self.bm.commit(seq, self.tokens[seq], self.computed[seq])
        self.bm.release_outside_window(seq, self.computed[seq])

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, prompt):
        seq = self.next_id
        self.next_id += 1
        blocks, keys = self.bm.lookup(prompt)
        start = len(blocks) * BS
        pairs = self.bm.allocate(seq, len(prompt), start, prefix=blocks, prefix_keys=keys)
        if pairs is None:
            assert seq not in self.bm.tables
            return
        assert pairs == []
        self.tokens[seq] = list(prompt)
        self.computed[seq] = start
        self._write(seq, start, len(prompt))
        self.computed[seq] = len(prompt)
        self.bm.commit(seq, self.tokens[seq], len(prompt))
        self.bm.release_outside_window(seq, len(prompt))

    @rule(prefix=st.lists(st.integers(0, 2), min_size=1, max_size=10),
          suffixes=st.lists(st.lists(st.integers(0, 2), max_size=5), min_size=2, max_size=4),
          first_chunk=st.integers(1, 16), abandon=st.booleans())
    def admit_together(self, prefix, suffixes, first_chunk, abandon):
        """Several requests sharing a prefix admitted in one step, the way the scheduler does it: each maps
        what the earlier ones publish ahead (the first may schedule only `first_chunk` tokens), then the
        step writes everything before anyone reads. An abandoned step (then aborted) writes nothing."""
        admitted = []  # (seq, prompt, chunk end)
        for i, suffix in enumerate(suffixes):
            prompt = prefix + suffix
            seq = self.next_id
            self.next_id += 1
            blocks, keys = self.bm.lookup(prompt)
            start = len(blocks) * BS
            end = max(start + 1, min(len(prompt), first_chunk)) if i == 0 else len(prompt)
            if self.bm.allocate(seq, end, start, prefix=blocks, prefix_keys=keys) is None:
                continue
            self.bm.publish_ahead(seq, prompt, end)
            self.tokens[seq] = list(prompt)
            self.computed[seq] = 0  # nothing readable until the step runs
            admitted.append((seq, prompt, start, end))
        if abandon:
            for seq, *_ in admitted:
                self.bm.free_seq(seq)
                del self.tokens[seq], self.computed[seq]
            assert not self.bm.pending
            return
        for seq, _prompt, start, end in admitted:
            self._write(seq, start, end)
        for seq, prompt, _start, end in admitted:
            self.tokens[seq] = prompt[:end]
            self.computed[seq] = end
            self.bm.commit(seq, prompt, end)
            self.bm.release_outside_window(seq, end)
        assert not self.bm.pending

    def _resident(self):
        return sorted(s for s in self.tokens if s not in self.swapped)

    @precondition(lambda self: any(s not in self.swapped for s in self.tokens))
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data, n):
        seq = data.draw(st.sampled_from(self._resident()))
        self._grow(seq, data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))

    @precondition(lambda self: any(s not in self.swapped for s in self.tokens))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._resident()))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free_seq(seq)
        del self.tokens[seq], self.computed[seq]
        self.swapped.discard(seq)

    @precondition(lambda self: any(s not in self.swapped for s in self.tokens))
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self._resident()))
        if not self.bm.can_swap_out([seq]):
            return
        for dev, host in self.bm.swap_out([seq]):
            self.host[host] = list(self.mem[dev])
        self.swapped.add(seq)

    @precondition(lambda self: bool(self.swapped))
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        if not self.bm.can_swap_in([seq]):
            return
        for host, dev in self.bm.swap_in([seq]):
            self.mem[dev] = list(self.host[host])
        self.swapped.discard(seq)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check()
        assert self.bm.num_free + self.bm.num_used == self.bm.num_blocks
        for seq, toks in self.tokens.items():
            mem, table = (self.host, self.bm.host_tables[seq]) if seq in self.swapped else (self.mem, self.bm.tables[seq])
            computed = self.computed[seq]
            # what the next token's window sees must be there; what lies before it may have been released
            seen = 0 if self.window is None else max(0, computed - self.window + 1)
            assert all(table[p // BS] != HOLE for p in range(seen, computed)), f"seq {seq} lost a block in its window"
            kept = [p for p in range(computed) if table[p // BS] != HOLE]
            got = [mem[table[p // BS]][p % BS] for p in kept]
            assert got == [toks[p] for p in kept], f"seq {seq} reads {got}, wrote {toks}"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free_seq(seq)
        self.bm.check()
        assert self.bm.num_used == 0 and self.bm.num_host_used == 0


TestBlockManager = BlockMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_prefix_hit_reuses_freed_blocks_and_verifies_tokens():
    bm = BlockManager(8, BS, watermark=0.0)
    prompt = list(range(10))
    assert bm.allocate(1, 10, 0) == []
    bm.commit(1, prompt, 10)
    bm.free_seq(1)  # blocks keep their keys in the free queue
    blocks, _ = bm.lookup(prompt + [99])
    assert len(blocks) == 2
    # a collision (same hash, different tokens) is a miss, not a wrong hit
    h, toks = bm.block_key[blocks[0]]
    bm.block_key[blocks[0]] = (h, (7, 7, 7, 7))
    assert bm.lookup(prompt)[0] == []


def test_blocks_published_ahead_are_shared_in_the_same_step_and_confirmed_by_commit():
    bm = BlockManager(16, BS, watermark=0.0)
    prefix = list(range(12))  # 3 full blocks
    assert bm.allocate(1, 14, 0) == []
    assert bm.publish_ahead(1, prefix + [50, 51], 14) == 3
    blocks, keys = bm.lookup(prefix + [60, 61])
    assert blocks == bm.block_table(1)[:3]  # the pending blocks of seq 1, before any was computed
    assert bm.allocate(2, 14, 12, prefix=blocks, prefix_keys=keys) == []
    assert [bm.ref[b] for b in blocks] == [2, 2, 2]
    bm.check()
    bm.commit(1, prefix + [50, 51], 14)
    bm.commit(2, prefix + [60, 61], 14)
    assert not bm.pending
    bm.free_seq(1)
    bm.free_seq(2)
    assert len(bm.lookup(prefix + [70])[0]) == 3  # confirmed: they stay in the cache
    bm.check()
    assert bm.num_used == 0


def test_blocks_published_ahead_of_a_step_that_never_ran_leave_the_cache():
    bm = BlockManager(16, BS, watermark=0.0)
    prompt = list(range(9))
    assert bm.allocate(1, 9, 0) == []
    assert bm.publish_ahead(1, prompt, 9) == 2
    bm.free_seq(1)  # aborted before the step's forward
    assert bm.lookup(prompt)[0] == [] and not bm.cached and not bm.pending
    bm.check()


def test_publish_ahead_is_off_without_prefix_caching():
    bm = BlockManager(16, BS, watermark=0.0, enable_prefix_caching=False)
    assert bm.allocate(1, 9, 0) == []
    assert bm.publish_ahead(1, list(range(9)), 9) == 0
    assert bm.lookup(list(range(9)) + [1])[0] == []


def test_copy_on_write_on_shared_partial_block():
    bm = BlockManager(8, BS, watermark=0.0)
    assert bm.allocate(1, 6, 0) == []
    bm.fork(1, 2)
    last = bm.block_table(1)[1]
    assert bm.ref[last] == 2
    pairs = bm.allocate(2, 7, 6)  # seq 2 writes position 6, inside the shared second block
    assert pairs == [(last, bm.block_table(2)[1])] and bm.block_table(2)[1] != last
    assert bm.ref[last] == 1 and bm.block_table(1)[0] == bm.block_table(2)[0]
    assert bm.allocate(1, 7, 6) == []  # now seq 1 owns its block alone: no copy
    bm.free_seq(1)
    bm.free_seq(2)
    bm.check()
    assert bm.num_used == 0


def test_watermark_blocks_admission_but_not_growth():
    bm = BlockManager(100, BS, watermark=0.05)
    assert bm.allocate(1, 95 * BS, 0, admit=True) == []
    assert bm.allocate(2, BS, 0, admit=True) is None  # would dip under the 5-block watermark
    assert 2 not in bm.tables
    assert bm.allocate(1, 96 * BS, 95 * BS) == []  # a running sequence may use it


def test_blocks_behind_a_sliding_window_go_back_and_their_entries_become_holes():
    bm = BlockManager(8, BS, watermark=0.0, sliding_window=5)
    tokens = list(range(13))
    assert bm.allocate(1, 13, 0) == []
    bm.commit(1, tokens, 13)
    bm.release_outside_window(1, 13)  # the next token (13) sees keys 9..13: blocks 0 and 1 (positions 0-7) go
    table = bm.block_table(1)
    assert table[:2] == [HOLE, HOLE] and HOLE not in table[2:] and bm.num_used == 2
    assert bm.lookup(tokens + [99])[0][:2] != []  # their K/V stay in the prefix cache
    bm.fork(1, 2)  # a fork shares the held blocks only
    assert bm.block_table(2)[:2] == [HOLE, HOLE] and [bm.ref[b] for b in table[2:]] == [2, 2]
    bm.free_seq(2)
    bm.num_host_blocks, bm.host_ref, bm.host_free = 4, [0] * 4, [3, 2, 1, 0]
    assert bm.swap_out([1]) == [(table[2], 0), (table[3], 1)]  # holes are not swapped
    assert bm.host_tables[1][:2] == [HOLE, HOLE]
    assert len(bm.swap_in([1])) == 2 and bm.block_table(1)[:2] == [HOLE, HOLE]
    bm.free_seq(1)
    bm.check()
    assert bm.num_used == 0
