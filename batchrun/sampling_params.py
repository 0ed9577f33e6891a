"""SamplingParams: vLLM's names and defaults, so a vLLM user changes one import."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields
from typing import Any

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, a regex, one of some strings, an EBNF grammar, or any
    JSON object (vLLM's names; exactly one of them). The output then always parses: every drawn token is
    one the grammar allows, and the sequence stops once the grammar has ended.

    json: a JSON schema, as a dict or its JSON text. grammar: EBNF (GBNF) with a `root` rule.
    disable_any_whitespace: JSON without free whitespace between tokens (compact, and a small model cannot
    loop on blank lines)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.structured_outputs {name + ' ' if name else ''}{why}")

        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            bad("", f"must set exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                    f"{', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                bad("json", f"is not valid JSON ({e})")
        elif self.json is not None and not isinstance(self.json, dict):
            bad("json", f"must be a JSON schema (a mapping or its JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(name, f"must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                bad("choice", f"must be a non-empty list of non-empty strings, got {self.choice!r}")
        if self.json_object not in (None, True, False):
            bad("json_object", f"must be true or false, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            bad("disable_any_whitespace", f"must be true or false, got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, its text, free whitespace). A schema's key order is
        kept (it is the order the fields are generated in)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else _json.dumps(value)
        elif kind == "choice":
            text = _json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, not self.disable_any_whitespace

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsParams:
        """From a StructuredOutputsParams or a mapping of its fields (a job file's, a row's)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError:
                raise ValueError("SamplingParams.structured_outputs must be a mapping (or its JSON text) such "
                                 f"as {{json: <schema>}}, got {value[:40]!r}") from None
        if not isinstance(value, dict):
            raise ValueError("SamplingParams.structured_outputs must be a mapping such as {json: <schema>}, "
                             f"got {type(value).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ValueError(f"SamplingParams.structured_outputs has an unknown key {unknown[0]!r} "
                             f"(known: {', '.join(names)})")
        return cls(**value)


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise ValueError naming the field, at construction."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # a JSON schema, regex, choice or grammar the output must follow (a mapping of its fields is taken too)
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None  # K: each prompt token's log-probability and the K most likely there
    # the Python API's only (vLLM's names): not job keys
    detokenize: bool = True  # False: no text, no decoded tokens in the log-probabilities
    spaces_between_special_tokens: bool = True  # accepted; the tokenizer's own decoding decides
    logits_processors: list | None = None  # vLLM's hook: only None or [] (batchrun runs none)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop) if self.stop else []
        self.stop_token_ids = list(self.stop_token_ids) if self.stop_token_ids else []
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            bad("n", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not is_num(getattr(self, name)) or getattr(self, name) != getattr(self, name):
                bad(name, "must be a number")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            bad("max_tokens", "must be an integer >= 0 (0: the prompt only; None for up to max_model_len)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of them")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be an integer >= 0 or None")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            bad("prompt_logprobs", "must be an integer >= 0 or None")
        if self.logits_processors:
            bad("logits_processors", "is not supported (batchrun runs no Python logits processors; "
                                     "structured_outputs constrains the output)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")

    @classmethod
    def field_names(cls) -> list[str]:
        """The user-settable fields (what a job file's `sampling:` section may name)."""
        return [f.name for f in fields(cls) if not f.name.startswith("_") and f.name not in API_ONLY]


API_ONLY = ("detokenize", "spaces_between_special_tokens", "logits_processors")  # not job keys

# What each field means, for a user: the `sampling:` section of docs/jobs.md is generated from these and the
# fields' defaults (docs/gen_jobs.py; tests/test_docs.py fails when a field has no entry here).
FIELD_DOCS: dict[str, str] = {
    "n": "Samples per prompt; in a job, one output row each, with `sample_index` 0..n-1.",
    "temperature": "0: greedy (the argmax); higher: flatter.",
    "top_p": "Nucleus sampling: draw from the smallest set of tokens whose probabilities sum to at least this, in (0, 1].",
    "top_k": "Draw from the k most likely tokens; 0 or -1: all.",
    "min_p": "Drop tokens less likely than this times the most likely one's probability.",
    "repetition_penalty": "Above 1: tokens already in the prompt or the output are less likely (> 0).",
    "presence_penalty": "Subtracted from the logit of every token already generated, in [-2, 2].",
    "frequency_penalty": "Subtracted from a token's logit once per time it was generated, in [-2, 2].",
    "max_tokens": "The most tokens generated; a completion ends earlier at the end of sequence or a stop. "
                  "0: none (the prompt only, e.g. for `prompt_logprobs`); null: up to max_model_len.",
    "min_tokens": "End of sequence and stop tokens are banned until this many tokens are generated.",
    "stop": "A string or a list of strings that end the completion (not included unless "
            "`include_stop_str_in_output`).",
    "stop_token_ids": "Token ids that end the completion, besides the model's end of sequence.",
    "ignore_eos": "Keep generating past the end-of-sequence token (up to `max_tokens`).",
    "seed": "The request's random stream. In a job, row i samples with seed + i (or a `seed` column); null: a "
            "seed derived from the engine's seed and the request's place, not reproducible across runs.",
    "logprobs": "N: for each generated token, the log-probabilities of the N most likely tokens and of the drawn one.",
    "include_stop_str_in_output": "Keep the stop string that ended the completion in its text.",
    "skip_special_tokens": "Leave special tokens out of the text.",
    "prompt_logprobs": "K: for each prompt token after the first, its log-probability, its rank and the K most "
                       "likely tokens there (a `prompt_logprobs` column in a job).",
    "structured_outputs": "Constrain the output: one of `{json: <schema>}` (`json_file: schema.json` in a job file), "
                          "`{regex: ...}`, `{choice: [a, b]}`, `{grammar: <EBNF>}`, `{json_object: true}`; "
                          "`disable_any_whitespace: true` for compact JSON. Needs `batchrun[structured]`.",
}


def scores_prompt(params: SamplingParams | None) -> bool:
    """A request that asks for its prompt's log-probabilities or generates nothing: its prompt may fill the
    context (an evaluation harness's windows of exactly max_model_len tokens)."""
    return params is not None and (params.prompt_logprobs is not None or params.max_tokens == 0)
