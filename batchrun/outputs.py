"""What generate() returns: vLLM's RequestOutput / CompletionOutput / Logprob shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """A token's log-probability: this float itself (also `.logprob`, vLLM's name), with its `rank` in the
    vocabulary (1: the most likely) and `decoded_token` (None when the request asked `detokenize=False`)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # With SamplingParams.logprobs = N: one dict per generated token, {token_id: Logprob} for the top N and
    # the sampled token.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    # set when the text is not what was asked: a structured output cut off before its grammar completed
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With SamplingParams.prompt_logprobs = K: one entry per prompt token, None for the first, else
    # {token_id: Logprob} for the prompt's own token and the K most likely there.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    lora_request: None = None  # vLLM's field; batchrun runs no adapters


@dataclass
class PoolingOutput:
    """A pooled prompt's vector: an embedding, or a classifier's logits."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """What LLM.encode returns per prompt (vLLM's shape); the typed views below read `outputs`."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (sigmoid of a one-label head), or the raw logits without activation

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's score, or the cosine of two embeddings


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
