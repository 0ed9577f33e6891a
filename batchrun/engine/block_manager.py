"""Paged KV accounting: which device and host blocks each sequence owns. Pure Python; `check` holds the invariants.

A block's ref count is the number of tables holding it (0: free, in an LRU queue); writing into a shared block
copies it first (a (src, dst) pair the runner copies). A full block is keyed by a hash chained over (parent key,
its tokens), a hit checked against the stored tokens; a freed block keeps its key until reused. `publish_ahead`
keys the blocks a step fills before it runs (every backend stores a step's K/V before it attends), `commit`
confirms them, `free_seq` unpublishes the rest. `release_outside_window` frees blocks before a sliding window."""

from __future__ import annotations

from collections import OrderedDict

HOLE = -1  # a released block's entry (sliding window): the table keeps its length; a hole is never read or moved


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks kept free when admitting new work, so running sequences can still grow a little.
        self.watermark_blocks = int(watermark * num_blocks)

        self.ref = [0] * num_blocks
        # free blocks, taken from the front: unkeyed ones go to the front, keyed ones to the back (cached longest)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (hash, tokens)
        self.cached: dict[int, int] = {}  # hash -> device block holding that prefix block
        self.tables: dict[int, list[int]] = {}  # seq_id -> device block ids
        self.hashes: dict[int, list[int]] = {}  # seq_id -> chain hash of each of its full blocks
        # seq_id -> blocks it published ahead of the step that computes them, not yet confirmed by `commit`
        self.pending: dict[int, list[int]] = {}

        # the keys every layer sees (None: some layer sees all); per sequence, how many leading entries are HOLE
        self.sliding_window = sliding_window
        self.released: dict[int, int] = {}

        self.num_host_blocks = num_host_blocks
        self.host_ref = [0] * num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.host_tables: dict[int, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_host_used(self) -> int:
        return self.num_host_blocks - len(self.host_free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_resident(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self.host_tables

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's device block ids in order: the live list, read only."""
        return self.tables[seq_id]

    def decode_slot(self, seq_id: int, position: int) -> list[int] | None:
        """Decode fast path: room for the token at `position` (in a private block, or one new block) and the
        live table; None when `allocate` must decide."""
        table = self.tables.get(seq_id)
        if table is None:
            return None
        i = position // self.block_size
        if i < len(table):
            return table if self.ref[table[i]] == 1 else None
        if i == len(table) and self.free:
            table.append(self._take_free())
            return table
        return None

    def num_distinct_blocks(self, seq_ids: list[int]) -> int:
        """Device blocks held by any of the sequences, shared ones counted once."""
        blocks = {b for s in seq_ids for b in self.tables.get(s, ())}
        blocks.discard(HOLE)
        return len(blocks)

    def num_cached_blocks(self, keys: list[int]) -> int:
        """How many leading keys (from chain_keys) have a cached block now."""
        n = 0
        for key in keys:
            if key not in self.cached:
                break
            n += 1
        return n

    # ---- prefix cache ----------------------------------------------------------------------------
    @staticmethod
    def _chain(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    def chain_keys(self, token_ids: list[int]) -> list[int]:
        """The keys of the full blocks `lookup` would consider."""
        keys: list[int] = []
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            keys.append(self._chain(keys[-1] if keys else None, tuple(token_ids[i * bs : (i + 1) * bs])))
        return keys

    def lookup(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Leading cached full blocks and their keys; at least one token stays to compute (it yields the logits)."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._chain(parent, toks)
            b = self.cached.get(h)
            if b is None or self.block_key[b] != (h, toks):
                break
            blocks.append(b)
            keys.append(h)
            parent = h
        return blocks, keys

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Key the blocks `num_computed` tokens have filled, for reuse; confirms what was published ahead."""
        if not self.enable_prefix_caching:
            return
        if self.pending:  # the step ran: what the sequence published ahead of it is computed now
            self.pending.pop(seq_id, None)
        keys = self.hashes.get(seq_id)
        if keys is not None and len(keys) >= num_computed // self.block_size:
            return  # the common decode step: no block filled (checked here, without a call)
        self._publish(seq_id, token_ids, num_computed)

    def publish_ahead(self, seq_id: int, token_ids: list[int], num_tokens: int) -> int:
        """Key the blocks this step fills up to `num_tokens` before it runs, once nothing of it can be preempted."""
        if not self.enable_prefix_caching:
            return 0
        published = self._publish(seq_id, token_ids, num_tokens)
        if published:
            self.pending.setdefault(seq_id, []).extend(published)
        return len(published)

    def _publish(self, seq_id: int, token_ids: list[int], num_tokens: int) -> list[int]:
        keys = self.hashes.setdefault(seq_id, [])
        bs = self.block_size
        if len(keys) >= num_tokens // bs:
            return []
        table = self.tables[seq_id]
        published: list[int] = []
        for i in range(len(keys), num_tokens // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._chain(keys[-1] if keys else None, toks)
            keys.append(h)
            b = table[i]
            if self.block_key[b] is None and h not in self.cached:
                self.block_key[b] = (h, toks)
                self.cached[h] = b
                published.append(b)
        return published

    def _unpublish(self, b: int) -> None:
        key = self.block_key[b]
        if key is not None:
            if self.cached.get(key[0]) == b:
                del self.cached[key[0]]
            self.block_key[b] = None

    # ---- allocation ------------------------------------------------------------------------------
    def _take_free(self) -> int:
        b, _ = self.free.popitem(last=False)
        key = self.block_key[b]
        if key is not None:  # evict its prefix-cache entry: the block is about to be overwritten
            if self.cached.get(key[0]) == b:
                del self.cached[key[0]]
            self.block_key[b] = None
        self.ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free[b] = None
            if self.block_key[b] is None:
                self.free.move_to_end(b, last=False)

    def allocate(self, seq_id: int, num_tokens: int, write_from: int, *, prefix: list[int] | None = None,
                 prefix_keys: list[int] | None = None, admit: bool = False) -> list[tuple[int, int]] | None:
        """Cover `num_tokens` tokens, writing from `write_from`; `prefix` from `lookup` on a first allocation,
        `admit` keeps the watermark free. The copy-on-write pairs, or None (nothing changed) when blocks are short."""
        table = self.tables.get(seq_id)
        if table is not None and not prefix:  # the common decode case: room left, nothing shared
            have = len(table) * self.block_size
            if num_tokens <= have and (write_from >= have or self.ref[table[write_from // self.block_size]] == 1):
                return []
        prefix = prefix or []
        if table is None:
            table = []
        elif prefix:
            raise ValueError("a prefix is only given on a sequence's first allocation")
        need = self.blocks_for(num_tokens) - len(table) - len(prefix)
        cow = write_from < len(table) * self.block_size and self.ref[table[write_from // self.block_size]] > 1
        taken_from_free = sum(1 for b in prefix if self.ref[b] == 0)
        avail = len(self.free) - taken_from_free - (self.watermark_blocks if admit else 0)
        if max(need, 0) + cow > avail:
            return None

        self.tables[seq_id] = table
        for b in prefix:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            table.append(b)
        if prefix_keys:
            self.hashes[seq_id] = list(prefix_keys)
        copies: list[tuple[int, int]] = []
        if cow:
            i = write_from // self.block_size
            src, dst = table[i], self._take_free()
            self.ref[src] -= 1  # was > 1: stays held by the others
            table[i] = dst
            copies.append((src, dst))
        for _ in range(need):
            table.append(self._take_free())
        return copies

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Give back the blocks past blocks_for(num_tokens): private, unpublished blocks of rejected drafts."""
        table = self.tables.get(seq_id)
        keep = self.blocks_for(num_tokens)
        while table is not None and len(table) > keep:
            self._release(table.pop())

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent."""
        table = list(self.tables[parent_id])
        for b in table:
            if b != HOLE:
                self.ref[b] += 1
        self.tables[child_id] = table
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))
        if parent_id in self.released:
            self.released[child_id] = self.released[parent_id]

    def release_outside_window(self, seq_id: int, num_computed: int) -> None:
        """Give back the blocks wholly before num_computed - W + 1, which no later token sees (window W)."""
        window = self.sliding_window
        table = self.tables.get(seq_id)
        if window is None or table is None:
            return
        end = min((num_computed - window + 1) // self.block_size, len(table) - 1)  # (the last block stays)
        start = self.released.get(seq_id, 0)
        if end <= start:
            return
        for i in range(start, end):
            b = table[i]
            table[i] = HOLE
            self._release(b)
        self.released[seq_id] = end

    def free_seq(self, seq_id: int) -> None:
        """Give back a sequence's device and host blocks; its tail blocks are evicted first."""
        if self.pending:
            for b in self.pending.pop(seq_id, ()):  # published ahead of a step that never ran: never computed
                self._unpublish(b)
        for b in reversed(self.tables.pop(seq_id, [])):
            if b != HOLE:
                self._release(b)
        for h in self.host_tables.pop(seq_id, []):
            if h == HOLE:
                continue
            self.host_ref[h] -= 1
            if self.host_ref[h] == 0:
                self.host_free.append(h)
        self.hashes.pop(seq_id, None)
        if self.released:
            self.released.pop(seq_id, None)

    # ---- swap ------------------------------------------------------------------------------------
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_distinct_blocks(seq_ids) <= len(self.host_free)

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the host, sharing kept; (device, host) pairs."""
        mapping: dict[int, int] = {}
        for s in seq_ids:
            host_table = []
            for b in self.tables.pop(s):
                if b == HOLE:
                    host_table.append(HOLE)
                    continue
                if b not in mapping:
                    mapping[b] = self.host_free.pop()
                h = mapping[b]
                self.host_ref[h] += 1
                host_table.append(h)
                self._release(b)
            self.host_tables[s] = host_table
        return list(mapping.items())

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        distinct = {h for s in seq_ids for h in self.host_tables.get(s, [])}
        distinct.discard(HOLE)
        return len(distinct) + self.watermark_blocks <= len(self.free)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back into fresh device blocks; (host, device) pairs."""
        mapping: dict[int, int] = {}
        for s in seq_ids:
            table = []
            for h in self.host_tables.pop(s):
                if h == HOLE:
                    table.append(HOLE)
                    continue
                if h not in mapping:
                    mapping[h] = self._take_free()
                else:
                    self.ref[mapping[h]] += 1
                table.append(mapping[h])
                self.host_ref[h] -= 1
                if self.host_ref[h] == 0:
                    self.host_free.append(h)
            self.tables[s] = table
        return list(mapping.items())

    # ---- invariants (tests) ------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless the accounting is consistent."""
        holders = [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            held = [b for b in table if b != HOLE]
            assert len(set(held)) == len(held), "a table holds a block twice"
            assert HOLE not in table[self.released.get(seq_id, 0):], "a hole past the released blocks"
            for b in held:
                holders[b] += 1
        assert holders == self.ref, "ref counts differ from the tables holding the blocks"
        assert set(self.free) == {b for b in range(self.num_blocks) if self.ref[b] == 0}
        for h, b in self.cached.items():
            assert self.block_key[b] is not None and self.block_key[b][0] == h
        for seq_id, blocks in self.pending.items():  # pending blocks are held, keyed, by their publisher
            table = self.tables.get(seq_id)
            assert table is not None, "a sequence that is not resident has pending blocks"
            for b in blocks:
                assert b in table and self.block_key[b] is not None and self.cached.get(self.block_key[b][0]) == b
        host_holders = [0] * self.num_host_blocks
        for table in self.host_tables.values():
            for h in table:
                if h != HOLE:
                    host_holders[h] += 1
        assert host_holders == self.host_ref, "host ref counts differ from the host tables"
        assert sorted(self.host_free) == [h for h in range(self.num_host_blocks) if self.host_ref[h] == 0]
