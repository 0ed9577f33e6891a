"""StructuredOutputs: one model's grammar compiler; each distinct spec compiled once (failures too), time-limited.
A matcher lives on the engine's Sequence, which owns every event that changes it (a draw, a fork, the finish; a
preemption changes nothing); the runner only reads it to fill the step's token bitmask."""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

from batchrun.sampling_params import StructuredOutputsParams

try:
    import xgrammar as xgr
except ImportError as _missing:  # an optional extra: say how to get it, in one line
    raise ImportError("structured outputs need xgrammar: pip install 'batchrun[structured]'") from _missing

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0


class StructuredOutputError(ValueError):
    pass


# xgrammar's '[time] file.cc:line:' prefix
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _one_line(err: BaseException) -> str:
    text = _XGR_PREFIX.sub("", str(err).strip())
    first = text.splitlines()[0] if text else type(err).__name__
    return first[:300]


def choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)  # JSON escapes are EBNF's


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...] | list[int],
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_threads: int = 2) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout_s = timeout_s
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._cache: dict[tuple[str, str, bool], xgr.CompiledGrammar | StructuredOutputError] = {}
        self._lock = threading.Lock()

    def _compile_now(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, text, any_whitespace = spec.key
        if kind == "json":
            return self.compiler.compile_json_schema(text, any_whitespace=any_whitespace)
        if kind == "json_object":
            if any_whitespace:
                return self.compiler.compile_builtin_json_grammar()
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(spec.choice))
        return self.compiler.compile_grammar(text)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (cached); StructuredOutputError if it does not compile in time."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
        if hit is None:
            hit = self._compile_in_time(spec)
            with self._lock:
                self._cache[key] = hit
        if isinstance(hit, StructuredOutputError):
            raise hit
        return hit

    def _compile_in_time(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar | StructuredOutputError:
        """Wait at most timeout_s on a daemon thread: an overrunning compile holds neither the job nor its exit."""
        result: list = []

        def work() -> None:
            try:
                result.append(self._compile_now(spec))
            except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for every kind of bad input
                result.append(StructuredOutputError(f"the {spec.kind} does not compile: {_one_line(e)}"))

        worker = threading.Thread(target=work, name="grammar-compile", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if not result:
            log.warning("a %s grammar did not compile within %g s", spec.kind, self.timeout_s)
            return StructuredOutputError(f"the {spec.kind} did not compile within {self.timeout_s:g} s "
                                         "(engine.grammar_compile_timeout_s)")
        return result[0]

    def check(self, spec: StructuredOutputsParams) -> str | None:
        """None when `spec` compiles (and is now cached), else a one-line reason."""
        try:
            self.compile(spec)
        except StructuredOutputError as e:
            return str(e)
        return None

    def matcher(self, spec: StructuredOutputsParams) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=self.stop_token_ids or None)
