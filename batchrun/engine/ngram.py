"""Draft tokens for speculative decoding by prompt lookup (n-gram matching): no draft model.

A sequence's next tokens often repeat something already in its context (a quoted passage, a list's
pattern, a loop a small model falls into). The drafter finds the latest earlier occurrence of the sequence's
last n tokens (n = MAX_N down to 1) and proposes the tokens that followed it; when those run into the end of
the context (a loop shorter than the draft), it repeats them, as an earlier turn of the loop would read. The scheduler puts them after
the sequence's decode token; one forward then checks them all, and the engine keeps the drafts that match
what decoding draws at each position (the argmax, or for a sampled row its seeded draw of that position, which
is a function of the seed and the position only: model/sampling/sampler.py), plus the model's own next token: one to 1 + k tokens for
one pass over the weights. A wrong draft costs only its row of compute.

The index maps every n-gram of the context to where its latest occurrence ends; it is extended by the tokens
appended since the last proposal, so a step costs O(new tokens), not O(context).

Which of a sequence's drafts a step checks is draft_policy.py's choice, from how often this sequence's drafts were
kept (its KeepRate, updated by record) and what rows cost at the step's size.
"""

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
        """Up to k tokens likely to follow token_ids (none when its last tokens occurred nowhere before). A
        shorter proposal is a prefix of a longer one."""
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
                # the match is recent (a loop of period length - end): what followed it runs into the present,
                # and repeating that period is what copying an earlier turn of the loop would give
                period = length - end
                return [token_ids[end + j % period] for j in range(k)]
        return []

    def record(self, num_drafted: int, num_kept: int) -> None:
        """The outcome of a step's drafts (the first num_kept of num_drafted were kept)."""
        self.keep.record(num_drafted, num_kept)
