"""Incremental detokenization and stop strings.

Text is decoded one token at a time with `tokenizers`' DecodeStream (which holds back partial UTF-8
sequences), seeded with the end of the prompt so word-boundary spaces come out as in a full decode.
A stop string is looked for only in the window the new text can complete, so it is found even when it
spans several tokens, at a cost independent of the text's length.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = 8  # prompt tokens fed first, for tokenizers whose decoding depends on the left context


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop: bool) -> None:
        self._tok = tokenizer._tokenizer  # the Rust tokenizer behind the HF fast tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids[-_PROMPT_CONTEXT:]), skip_special_tokens=skip_special_tokens)
        self._vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.stop = stop
        self.include_stop = include_stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""

    def add(self, token_id: int) -> str | None:
        """Append a token's text; return the stop string it completed, if any (text is then truncated)."""
        if token_id >= self._vocab:  # a padded vocabulary row the tokenizer has no text for
            return None
        chunk = self._stream.step(self._tok, token_id)
        if not chunk:
            return None
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += chunk
        if not self.stop:
            return None
        best, where = None, len(self.text)
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and i < where:
                best, where = s, i
        if best is not None:
            self.text = self.text[: where + (len(best) if self.include_stop else 0)]
        return best
