"""PartPatcher: rows of committed parts computed again, written back into their parts in place.

A damaged part is rebuilt once its whole range is back; a part with `--retry-errors` rows is also rewritten with
what is back at each timed commit and stop. Each rewrite is atomic (ParquetSink.replace_part): the output is
whole at every moment."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchrun.io.rows import RowTask

if TYPE_CHECKING:
    from batchrun.output.sink import Sink

Patched = tuple[RowTask, Any, bool]  # (task, outputs, write)


class PartPatcher:
    def __init__(self, sink: Sink, parts: dict[int, list[int]], whole: set[int]) -> None:
        """parts: part index -> the positions of it to compute again; whole: the parts rebuilt whole."""
        self.sink = sink
        self.whole = set(whole)
        self.todo = {index: set(positions) for index, positions in parts.items() if positions}
        self.part_of = {pos: index for index, positions in self.todo.items() for pos in positions}
        self.done: dict[int, dict[int, Patched]] = {}

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(sorted(self.part_of))

    def wants(self, pos: int) -> bool:
        return pos in self.part_of

    @property
    def held(self) -> int:
        """Rows back but not yet written into their part."""
        return sum(len(rows) for rows in self.done.values())

    def put(self, task: RowTask, outputs: Any, write: bool) -> None:
        index = self.part_of.pop(task.pos)
        self.done.setdefault(index, {})[task.pos] = (task, outputs, write)
        self.todo[index].discard(task.pos)
        if not self.todo[index]:
            del self.todo[index]
            self._write(index)

    def flush(self) -> None:
        """Write what is back of the parts that may be written in pieces (a commit interval, a stop)."""
        for index in [i for i in self.done if i not in self.whole]:
            self._write(index)

    def check_done(self) -> None:
        if self.todo or self.done:
            left = sorted(p for positions in self.todo.values() for p in positions)
            raise RuntimeError(f"internal error: {len(left)} rows to compute again never came back "
                               f"(the first at position {left[:1]})")

    def _write(self, index: int) -> None:
        rows = self.done.pop(index)
        if rows:
            self.sink.replace_part(index, rows)
