"""Draft tokens by prompt lookup (n-gram matching), no draft model: the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (n = MAX_N down to 1), repeated when they reach the present (a loop).
One forward checks them; the engine keeps those decoding confirms. The index is extended by the new tokens only."""

from __future__ import annotations

from batchrun.engine.draft_policy import KeepRate

MAX_N = 3  # the longest suffix matched first: longer matches predict better, shorter ones match more often


class NgramDrafter:
    __slots__ = ("index", "indexed", "min_len", "max_len", "max_draft", "keep")

    def __init__(self, min_len: int, max_len: int, max_draft: int = 1 << 30, prior: KeepRate | None = None) -> None:
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest indexed occurrence
        self.indexed = 0  # n-grams ending at or before this position are in the index
        self.min_len = min_len  # drafts only from this length on (before it, min_tokens bans ids: not greedy)
        self.max_len = max_len  # the sequence stops at this length: no draft past it
        self.max_draft = max_draft
        self.keep = KeepRate(prior=prior)  # how often this sequence's drafts were kept (prior: every sequence's)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow token_ids; a shorter proposal is a prefix of a longer one."""
        length = len(token_ids)
        k = min(k, self.max_len - length - 1)  # the step's own token and the drafts stay within max_len
        if k <= 0 or length < self.min_len:
            return []
        # index the n-grams ending before the last token: the suffix's own occurrence is not a match
        index = self.index
        for end in range(self.indexed + 1, length):
            for n in range(1, min(MAX_N, end) + 1):
                index[tuple(token_ids[end - n : end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(MAX_N, length), 0, -1):
            end = index.get(tuple(token_ids[length - n :]))
            if end is not None:
                if length - end >= k:
                    return token_ids[end : end + k]
                # a recent match (a loop of period length - end): repeat the period, as an earlier turn would read
                period = length - end
                return [token_ids[end + j % period] for j in range(k)]
        return []

    def record(self, num_drafted: int, num_kept: int) -> None:
        self.keep.record(num_drafted, num_kept)
