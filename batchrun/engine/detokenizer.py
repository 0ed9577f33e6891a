"""Incremental detokenization (DecodeStream, seeded by the prompt's end) and stop strings, searched only where new
text can complete them. Without stop strings a sequence is `deferred`: decoded once at `finish`, to the same text."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = 8  # prompt tokens fed first, for tokenizers whose decoding depends on the left context


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop: bool) -> None:
        self._tok = tokenizer._tokenizer  # the Rust tokenizer behind the HF fast tokenizer
        self._context = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=skip_special_tokens)
        self._vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.stop = stop
        self.include_stop = include_stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.deferred = not stop  # nothing needs the text before the sequence ends
        self.text = ""

    def add(self, token_id: int) -> str | None:
        """Append a token's text; the stop string it completed, if any (the text cut there). Deferred: a no-op."""
        if self.deferred or token_id >= self._vocab:  # (a padded vocabulary row has no text)
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

    def finish(self, text_ids: list[int]) -> None:
        """The sequence ended: a deferred detokenizer decodes `text_ids` (the output less a final stop token)."""
        if not self.deferred:
            return
        ids = [t for t in text_ids if t < self._vocab]
        if not ids:
            return
        chunk = self._stream.step(self._tok, ids)
        if chunk is None:  # ends inside a character: what stepping one token at a time emits, exactly
            stream = DecodeStream(ids=self._context, skip_special_tokens=self._skip_special)
            chunk = "".join(c for c in (stream.step(self._tok, t) for t in ids) if c)
        self.text = chunk
        self.deferred = False
