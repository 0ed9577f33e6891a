"""Beam search API types (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"BeamSearchParams.{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            bad("beam_width", "must be an integer >= 1")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            bad("length_penalty", "must be a number")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    text: str  # the generated part, decoded
    cum_logprob: float
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first
