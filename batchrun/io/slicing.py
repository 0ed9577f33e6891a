"""RowSlice: which input rows are this run's (its shard, `--limit`, and resume after the last committed row).

A row has a global `index` in the input and a `pos` in this shard (what `--limit` counts and the parts record):
pos = index - base, or (index - base) // stride for a strided shard. A run computes positions [start, end) less
`ahead` (finished by an earlier run, kept aside), plus `redo` before `start` (a damaged part, `--retry-errors`).
The local executor reads with `read`; the Ray one takes its files and the Indexer's `position_of` (so: picklable).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from batchrun.io.sources import Row, Source

Batch = list[tuple[int, int, Row]]  # (pos, global index, row)


@dataclass(frozen=True)
class RowSlice:
    base: int = 0  # global index of position 0
    stride: int = 1  # 1: a contiguous shard; N: every N-th row (shard I of N, length unknown)
    start: int = 0  # the first position this run reads (rows before it are committed)
    length: int | None = None  # positions in the shard, when known (contiguous shards of a counted input)
    limit: int | None = None  # --limit: positions this shard may reach, in all runs together
    redo: tuple[int, ...] = ()  # positions before `start` to compute again, ascending
    ahead: tuple[int, ...] = ()  # positions from `start` on already finished (not computed again)

    def resumed(self, start: int, *, redo: tuple[int, ...] = (), ahead: tuple[int, ...] = (),
                new_rows: bool = True) -> RowSlice:
        """This slice resuming at position `start`, computing `redo` again and not `ahead`. new_rows False: only
        `redo` (--retry-errors computes no row that was not computed before)."""
        return dataclasses.replace(self, start=start, limit=self.limit if new_rows else start,
                                   redo=tuple(sorted(redo)), ahead=tuple(sorted(ahead)))

    @functools.cached_property
    def _redo(self) -> frozenset[int]:
        return frozenset(self.redo)

    @functools.cached_property
    def _ahead(self) -> frozenset[int]:
        return frozenset(self.ahead)

    # ------------------------------------------------------------ positions

    @property
    def end(self) -> int | None:
        """One past the last position this run may reach; None: wherever the input ends."""
        if self.length is None:
            return self.limit
        return self.length if self.limit is None else min(self.limit, self.length)

    @property
    def first(self) -> int:
        return self.redo[0] if self.redo else self.start

    @property
    def empty(self) -> bool:
        """Nothing to compute: no position to redo, and every one from `start` to `end` done already."""
        return self.next_wanted(self.first) is None

    def wants(self, pos: int) -> bool:
        if pos < self.start:
            return pos in self._redo
        end = self.end
        return (end is None or pos < end) and pos not in self._ahead

    def next_wanted(self, pos: int) -> int | None:
        """The first position >= pos this run computes; None when there is none."""
        i = bisect.bisect_left(self.redo, pos)
        if i < len(self.redo):
            return self.redo[i]
        pos = max(pos, self.start)
        j = bisect.bisect_left(self.ahead, pos)
        while j < len(self.ahead) and self.ahead[j] == pos:
            pos, j = pos + 1, j + 1
        end = self.end
        return None if end is not None and pos >= end else pos

    def index_of(self, pos: int) -> int:
        return self.base + pos * self.stride

    def position_of(self, index: int) -> int | None:
        """The position of global row `index`, or None when that row is not this run's."""
        offset = index - self.base
        if offset < 0 or offset % self.stride:
            return None
        pos = offset // self.stride
        return pos if self.wants(pos) else None

    def index_range(self) -> tuple[int, int | None]:
        """[first, stop) global indices that hold this run's rows (stop None: not known, or strided)."""
        last = self.last
        stop = None if self.stride > 1 or last is None else self.index_of(last)
        return self.index_of(self.first), stop

    @property
    def last(self) -> int | None:
        """One past the last position this run reads (None: wherever the input ends)."""
        end = self.end
        if self.redo and end is not None and self.start >= end:
            return self.redo[-1] + 1  # only rows to redo: read no further than the last of them
        return end

    # ------------------------------------------------------------ the end of a run

    def complete_at(self, pos: int) -> bool:
        """Is `pos`, where a run's reading stopped, the shard's end (else --limit stopped it; a rerun continues)?"""
        end = self.end
        if end is None or pos < end:
            return True  # the input ran out
        return self.limit is None or (self.length is not None and self.length <= self.limit)

    def short_at(self, pos: int) -> bool:
        """Rows up to `pos` came back although the shard is known to hold rows up to `end`."""
        end = self.end
        return self.length is not None and end is not None and pos < end

    # ------------------------------------------------------------ reading

    def read(self, source: Source, columns: list[str] | None) -> Iterator[Batch]:
        """This run's rows of `source`, in batches as the source reads them."""
        if self.empty:
            return
        last = self.last
        pos = self.first
        index = self.index_of(pos)
        for rows in source.iter_rows(index, columns):
            first = (self.base - index) % self.stride  # where this batch's first row of the shard sits
            kept = rows[first::self.stride] if self.stride > 1 else rows
            if last is not None:
                kept = kept[:last - pos]
            batch = [(pos + k, index + first + k * self.stride, row) for k, row in enumerate(kept)
                     if self.wants(pos + k)]
            pos += len(kept)
            index += len(rows)
            if batch:
                yield batch
            if last is not None and pos >= last:
                return
