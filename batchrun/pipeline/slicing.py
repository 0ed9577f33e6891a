"""RowSlice: which input rows are this run's (its shard, `--limit`, and resume after the last committed row).

Rows are numbered twice: a global `index` in the whole input, and a `pos`ition in this shard's stream of rows
(what `--limit` counts and what the output's parts record for resume). A contiguous shard holds indices
[base, base + length) and pos = index - base; a strided shard (an input whose length is unknown) holds every
`stride`-th row from `base`, pos = (index - base) // stride. A run reads positions [start, end): `start` is
where the committed rows end, `end` the shard's length or `--limit`, whichever is less.

Both executors use one RowSlice: the local one reads its rows with `read`, the Ray one picks the input files
and the Indexer's keep test (`position_of`) from it. The dataclass is small and picklable for that.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchrun.io.sources import Row, Source

if TYPE_CHECKING:
    from batchrun.plan import JobPlan

Batch = list[tuple[int, int, Row]]  # (pos, global index, row)


@dataclass(frozen=True)
class RowSlice:
    base: int = 0  # global index of position 0
    stride: int = 1  # 1: a contiguous shard; N: every N-th row (shard I of N, length unknown)
    start: int = 0  # the first position this run reads (rows before it are committed)
    length: int | None = None  # positions in the shard, when known (contiguous shards of a counted input)
    limit: int | None = None  # --limit: positions this shard may reach, in all runs together

    @classmethod
    def of_plan(cls, plan: JobPlan, start: int) -> RowSlice:
        """The slice a plan gives this shard (contiguous or strided, --limit), resuming at position `start`."""
        if plan.strided:
            return cls(base=plan.shard.index, stride=plan.shard.count, start=start, limit=plan.limit)
        length = None if plan.hi is None else plan.hi - plan.lo
        return cls(base=plan.lo, start=start, length=length, limit=plan.limit)

    # ------------------------------------------------------------ positions

    @property
    def end(self) -> int | None:
        """One past the last position this run may reach; None: wherever the input ends."""
        if self.length is None:
            return self.limit
        return self.length if self.limit is None else min(self.limit, self.length)

    @property
    def empty(self) -> bool:
        end = self.end
        return end is not None and self.start >= end

    def index_of(self, pos: int) -> int:
        return self.base + pos * self.stride

    def position_of(self, index: int) -> int | None:
        """The position of global row `index`, or None when that row is not this run's."""
        offset = index - self.base
        if offset < 0 or offset % self.stride:
            return None
        pos = offset // self.stride
        end = self.end
        if pos < self.start or (end is not None and pos >= end):
            return None
        return pos

    def index_range(self) -> tuple[int, int | None]:
        """[first, stop) global indices that hold this run's rows (stop None: not known, or strided)."""
        end = self.end
        stop = None if self.stride > 1 or end is None else self.index_of(end)
        return self.index_of(self.start), stop

    # ------------------------------------------------------------ the end of a run

    def complete_at(self, pos: int) -> bool:
        """A run read its rows up to position `pos`, stopping at `end` or where the input ran out: is
        that the end of the shard (else it stopped at --limit, and a rerun without it continues)?"""
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
        end = self.end
        pos, index = self.start, self.index_of(self.start)
        for rows in source.iter_rows(index, columns):
            first = (self.base - index) % self.stride  # where this batch's first row of the shard sits
            kept = rows[first::self.stride] if self.stride > 1 else rows
            if end is not None:
                kept = kept[:end - pos]
            batch = [(pos + k, index + first + k * self.stride, row) for k, row in enumerate(kept)]
            pos += len(kept)
            index += len(rows)
            if batch:
                yield batch
            if end is not None and pos >= end:
                return
