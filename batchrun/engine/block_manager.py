"""Paged KV accounting: which physical blocks each sequence owns. Pure Python, no tensors.

Device blocks live in one pool, host (swap) blocks in another. A block is shared by reference count
(prefix-cache hits, forked sequences); a sequence about to write into a block that others share gets a
private copy first (copy-on-write), reported as a (src, dst) pair for the runner to copy.

Prefix cache: a full block is keyed by a hash chained over (parent key, its token ids). Freed blocks keep
their key and wait in an LRU free queue, so a later request with the same prefix still finds them; a
block's key is dropped only when the block is taken for something else. A hit is checked against the
stored token ids, so a hash collision costs a miss, never a wrong answer.

Same-step sharing: the scheduler publishes the full blocks a step's chunk will fill *before* the step runs
(`publish_ahead`), so requests admitted later in that step map them instead of computing their common prefix
again. That is sound because every attention backend stores all of a step's K/V before it attends (per
layer), and no block of a step's chunks is freed or moved between scheduling and the forward. Such a block
is pending until `commit` (the step ran) confirms it; `free_seq` of a sequence whose pending blocks were
never confirmed (a step abandoned half way, then aborted) takes them out of the cache again.

Sliding windows: when every layer of the model attends only its last `sliding_window` keys (Mistral-style; the
engine passes None for a model with any global layer, whose layers then need every block), no query of a sequence
ever reads a block that lies wholly before its next token's window again. `release_outside_window` gives such
blocks back as the sequence advances; its table keeps its length (a position's block is still table[p // bs]) with
HOLE in their place. A hole is never read (the attention kernels start at the window), never swapped, copied or
counted; the prefix cache keeps the released blocks' keys like any freed block's.
"""

from __future__ import annotations

from collections import OrderedDict

HOLE = -1  # a table entry whose block fell out of the sliding window and went back


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
        # Free device blocks, evicted from the front. Unhashed blocks go to the front (reused first),
        # hashed ones to the back (kept as cache as long as possible).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (hash, tokens)
        self.cached: dict[int, int] = {}  # hash -> device block holding that prefix block
        self.tables: dict[int, list[int]] = {}  # seq_id -> device block ids
        self.hashes: dict[int, list[int]] = {}  # seq_id -> chain hash of each of its full blocks
        # seq_id -> blocks it published ahead of the step that computes them, not yet confirmed by `commit`
        self.pending: dict[int, list[int]] = {}

        # the keys every layer sees (None: some layer sees all), and per sequence how many leading entries are HOLE
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
        """The sequence holds device blocks."""
        return seq_id in self.tables

    def is_swapped(self, seq_id: int) -> bool:
        """The sequence's blocks are in the host pool."""
        return seq_id in self.host_tables

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's device block ids, logical order. The live list: callers only read it."""
        return self.tables[seq_id]

    def decode_slot(self, seq_id: int, position: int) -> list[int] | None:
        """The decode fast path: make room for the sequence's token at `position` and return its live
        table, when that needs no more than `allocate` does in the common case: nothing (the token lands
        in a block the sequence holds alone) or one free block (it starts a new block). None when
        `allocate` must decide (a shared block to copy, no free block, a table that does not reach)."""
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
        """How many leading prefix-cache keys (from chain_keys) have a block in the cache now."""
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
        """The keys of the full blocks of `token_ids` (the ones `lookup` would consider)."""
        keys: list[int] = []
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            keys.append(self._chain(keys[-1] if keys else None, tuple(token_ids[i * bs : (i + 1) * bs])))
        return keys

    def lookup(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Leading cached full blocks of `token_ids` (and their keys). At least one token is left to
        compute, since the step that computes it is the one that yields the next token's logits."""
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
        """Register the sequence's blocks that `num_computed` tokens have filled, so others can reuse them."""
        if not self.enable_prefix_caching:
            return
        if self.pending:  # the step ran: what the sequence published ahead of it is computed now
            self.pending.pop(seq_id, None)
        keys = self.hashes.get(seq_id)
        if keys is not None and len(keys) >= num_computed // self.block_size:
            return  # the common decode step: no block filled (checked here, without a call)
        self._publish(seq_id, token_ids, num_computed)

    def publish_ahead(self, seq_id: int, token_ids: list[int], num_tokens: int) -> int:
        """Publish now the full blocks that this step fills, up to `num_tokens` (the end of the sequence's
        scheduled chunk), before the forward computes them, so a request admitted later in the same step maps
        them (see the module docstring for why that is sound). Call it only once nothing more of the step can
        be preempted. Returns how many blocks were published."""
        if not self.enable_prefix_caching:
            return 0
        published = self._publish(seq_id, token_ids, num_tokens)
        if published:
            self.pending.setdefault(seq_id, []).extend(published)
        return len(published)

    def _publish(self, seq_id: int, token_ids: list[int], num_tokens: int) -> list[int]:
        """Key the sequence's blocks that `num_tokens` tokens fill; the ones that entered the cache."""
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
        """Take a block out of the prefix cache (its K/V were never computed)."""
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
        """Make the sequence's table cover `num_tokens` tokens, writing from position `write_from`.

        `prefix` are cached blocks from `lookup` (first allocation only). `admit` keeps the watermark free.
        Returns the copy-on-write pairs to perform, or None (and changes nothing) when blocks are short.
        """
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
        """Give back the blocks past the first blocks_for(num_tokens) of the sequence's table: blocks taken for
        draft tokens that were rejected (speculative decoding), so that only a sequence's last block is partly
        filled. They were private and never published."""
        table = self.tables.get(seq_id)
        keep = self.blocks_for(num_tokens)
        while table is not None and len(table) > keep:
            self._release(table.pop())

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; whoever writes into a shared block copies it first."""
        table = list(self.tables[parent_id])
        for b in table:
            if b != HOLE:
                self.ref[b] += 1
        self.tables[child_id] = table
        self.hashes[child_id] = list(self.hashes.get(parent_id, []))
        if parent_id in self.released:
            self.released[child_id] = self.released[parent_id]

    def release_outside_window(self, seq_id: int, num_computed: int) -> None:
        """With a sliding window of W keys, the sequence's next token (position num_computed) and every later one
        see keys from num_computed - W + 1 on: give back the blocks wholly before that (their entries become
        HOLE). Cheap when nothing crosses a block (most steps)."""
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
        """Give back a sequence's blocks (device or host). Tail blocks are queued for eviction first."""
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
        """Move the sequences' blocks to host blocks, keeping sharing among them. Returns (device, host)."""
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
        """Bring swapped sequences back into fresh device blocks. Returns (host, device) pairs."""
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
