"""The step's block tables as rows of one persistent host tensor (vLLM v1's persistent batch): a step rewrites only
the rows whose table changed and gathers its rows with one index_select."""

from __future__ import annotations

import array

import torch

from batchrun.engine.contract import ScheduledSeq


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of a list of ints, through an array: several times cheaper than torch.tensor(list)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def int32_tensor(values: list[int]) -> torch.Tensor:
    if not values:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer(array.array("i", values), dtype=torch.int32)


def decode_slots(seqs: list[ScheduledSeq], block_size: int) -> list[int]:
    """The pool slot of each sequence's one new token (at its start position): its block, then the offset in it."""
    return [s.block_table[s.start // block_size] * block_size + s.start % block_size for s in seqs]


class BlockTableRows:
    """Persistent host rows of the scheduled sequences' block tables (padded with 0)."""

    def __init__(self, width: int, rows: int = 64) -> None:
        self._buf = torch.zeros((rows, max(width, 1)), dtype=torch.int32)
        self._np = self._buf.numpy()
        self._row_of: dict[int, int] = {}  # seq_id -> its row
        self._written: list[list[int] | None] = [None] * rows  # the table each row holds (a copy)
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def gather(self, seqs: list[ScheduledSeq], width: int) -> torch.Tensor:
        """int32 [len(seqs), width]: row i is seqs[i].block_table[:width], padded with 0 (a new tensor)."""
        rows = self.rows_of(seqs)
        if width > self._buf.shape[1]:
            self._grow(len(self._written), width)
        return self._buf[:, :width].index_select(0, int64_tensor(rows))

    @property
    def table(self) -> torch.Tensor:
        """The kept rows, int32 [rows, width] (contiguous): rows_of's rows index it until the next call."""
        return self._buf

    def rows_of(self, seqs: list[ScheduledSeq]) -> list[int]:
        """The kept row of each of seqs' block tables (rewritten where changed); other sequences' rows go back."""
        row_of, written = self._row_of, self._written
        if len(row_of) > len(seqs):  # some sequences of earlier steps are not in this one
            self._release_unscheduled(seqs)
        rows: list[int] = []
        for s in seqs:
            r = row_of.get(s.seq_id)
            table = s.block_table
            if r is None:
                r = self._take_row(s.seq_id)
                self._write(r, table)
            elif written[r] != table:  # grew by a block, or was replaced (copy-on-write, swap, recompute)
                self._write(r, table)
            rows.append(r)
        return rows

    def _release_unscheduled(self, seqs: list[ScheduledSeq]) -> None:
        scheduled = {s.seq_id for s in seqs}
        for seq_id in [i for i in self._row_of if i not in scheduled]:
            r = self._row_of.pop(seq_id)
            self._free.append(r)

    def _take_row(self, seq_id: int) -> int:
        if not self._free:
            self._grow(2 * len(self._written), self._buf.shape[1])
        r = self._free.pop()
        self._row_of[seq_id] = r
        return r

    def _write(self, r: int, table: list[int]) -> None:
        n = len(table)
        if n > self._buf.shape[1]:
            self._grow(len(self._written), n)
        old = self._written[r]
        if old is not None and len(old) == n - 1 and table[: n - 1] == old:  # the usual change: one more block
            self._np[r, n - 1] = table[-1]
        else:
            self._np[r, :n] = table
            if n and table[0] < 0:  # blocks released behind a sliding window (HOLE, -1): never read, kept valid
                self._np[r, :n].clip(min=0, out=self._np[r, :n])
            if old is not None and len(old) > n:
                self._np[r, n : len(old)] = 0
        self._written[r] = list(table)

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self._buf.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        buf = torch.zeros((rows, width), dtype=torch.int32)
        buf[:old_rows, :old_width] = self._buf
        self._buf, self._np = buf, buf.numpy()
        self._written += [None] * (rows - old_rows)
        self._free += list(range(rows - 1, old_rows - 1, -1))
