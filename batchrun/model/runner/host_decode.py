"""Decode steps of the native call planned as host arrays (prepare()'s values, the kept block-table rows in
place): no torch call, each of which starts cold after the step's kernels have streamed the weights."""

from __future__ import annotations

from array import array

import torch

from batchrun.engine.contract import ScheduledSeq
from batchrun.model.arch.blocks import REFINE_TOP, CausalLM
from batchrun.model.arch.native_layers import NativeLayers, StepAddresses
from batchrun.model.runner.block_tables import BlockTableRows, decode_slots


def _address(values: array) -> int:
    return values.buffer_info()[0]


class HostDecode:
    """The runner's decode steps on its model's native call; built only where the call is the runner's own."""

    def __init__(self, model: CausalLM, native: NativeLayers, block_rows: BlockTableRows, block_size: int) -> None:
        self.model, self.native, self.block_rows, self.block_size = model, native, block_rows, block_size
        self._tokens = array("q", bytes(8 * native.max_rows))

    def run(self, seqs: list[ScheduledSeq], kv_cache: torch.Tensor) -> list[int] | None:
        """Each sequence's greedy token after its one new token, or None (the runner's path then runs the step)."""
        rows = len(seqs)
        head = self.model.greedy_head(rows) if rows <= self.native.max_rows else None
        if head is None:
            return None
        plan, _arrays = self._plan(seqs)
        packed, weight = head
        tokens = self._tokens
        if not self.native.call(rows, plan, kv_cache, (packed.data_ptr(), weight.data_ptr(), weight.shape[0],
                                                       REFINE_TOP + 1, _address(tokens))):
            return None
        return tokens[:rows].tolist()

    def hidden(self, seqs: list[ScheduledSeq], kv_cache: torch.Tensor) -> torch.Tensor | None:
        """The step's hidden states after the final norm (a workspace view, until the next step), or None."""
        rows = len(seqs)
        if rows > self.native.max_rows:
            return None
        plan, _arrays = self._plan(seqs)
        out = self.native.hidden_view(rows)
        self.native.call(rows, plan, kv_cache, None)
        return out

    def _plan(self, seqs: list[ScheduledSeq]) -> tuple[StepAddresses, tuple[array, ...]]:
        """prepare()'s values of a decode step, as host arrays (which the caller keeps until the call returns)."""
        starts = [s.start for s in seqs]
        ids = array("q", [s.token_ids[0] for s in seqs])
        positions = array("q", starts)
        slots = array("q", decode_slots(seqs, self.block_size))
        row_seq = array("i", self.block_rows.rows_of(seqs))  # each row's sequence: its kept table row
        row_len = array("i", [p + 1 for p in starts])
        table, model = self.block_rows.table, self.model
        plan = StepAddresses(_address(ids), _address(positions), _address(slots), table.data_ptr(), table.shape[1],
                             _address(row_seq), _address(row_len), model.cos.data_ptr(), model.sin.data_ptr())
        return plan, (ids, positions, slots, row_seq, row_len)
