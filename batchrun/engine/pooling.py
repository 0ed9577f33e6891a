"""A pooled request's state across its prompt's chunks: which rows each chunk pools and what is pooled so far."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.engine.contract import PoolingRequest, ScheduledSeq


@dataclass(slots=True)
class PoolingState:
    """mode: last | mean | cls (PoolingParams.pooling_type, resolved). head: the classifier applied to the pooled
    vector (in the runner: the pooled span must then lie in one chunk, as the last and first tokens always do)."""

    mode: str
    head: bool = False
    vector: list[float] | None = None  # the pooled vector once computed (a mean's running sum before the end)
    next_row: int = 0  # mean: the prompt positions pooled so far (a recomputed chunk pools nothing twice)

    @property
    def cache_limit(self) -> int | None:
        """Prompt tokens whose K/V may come from the prefix cache: every row a mean or the first token still needs
        must be computed. None: no limit (last-token pooling recomputes only the last token)."""
        if self.mode == "mean":
            return self.next_row
        if self.mode == "cls" and self.vector is None:
            return 0
        return None

    def request(self, index: int, chunk: ScheduledSeq, prompt_len: int) -> PoolingRequest | None:
        """What chunk `index` of the step pools, if anything."""
        end = chunk.start + len(chunk.token_ids)
        if self.mode == "last":
            return PoolingRequest(index, prompt_len - 1 - chunk.start, 1, "row", self.head) if end == prompt_len \
                else None
        if self.mode == "cls":
            return PoolingRequest(index, 0, 1, "row", self.head) if chunk.start == 0 and self.vector is None else None
        first = max(chunk.start, self.next_row)
        if first >= end:
            return None
        whole = first == 0 and end == prompt_len
        return PoolingRequest(index, first - chunk.start, end - first, "mean" if whole else "sum", self.head and whole)

    def add(self, request: PoolingRequest, pooled: list[float], chunk: ScheduledSeq, prompt_len: int) -> None:
        """Take one step's answer to `request`; a mean over several chunks is divided once its last row is in."""
        if request.reduce != "sum":
            self.vector = pooled
            self.next_row = prompt_len
            return
        self.vector = pooled if self.vector is None else [a + b for a, b in zip(self.vector, pooled)]
        self.next_row = chunk.start + request.first_row + request.num_rows
        if self.next_row == prompt_len:
            self.vector = [v / prompt_len for v in self.vector]


def prompt_only_kv_tokens(max_num_batched_tokens: int, longest: int, max_num_seqs: int, block_size: int) -> int:
    """Tokens prompt-only requests (pooled rows, freed in the step their prompt ends) hold at once: one step's
    chunks, a partly filled block for each of its sequences, and the one prompt a step leaves unfinished."""
    return max_num_batched_tokens + longest + min(max_num_seqs, max_num_batched_tokens) * block_size
