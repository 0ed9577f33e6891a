"""PoolingParams and the pooling modes: vLLM's names for embedding, classification and scoring requests."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")  # the hidden state of the last token, the mean of all, the first token's
POOLING_TASKS = ("embed", "classify", "score", "reward", "encode")


@dataclass
class PoolingParams:
    """How one prompt is pooled (vLLM's PoolingParams, with batchrun's `normalize` and `pooling_type`).

    dimensions: keep the embedding's first N values (Matryoshka models), then normalise. use_activation: embed:
    L2-normalise (the checkpoint's choice where None); classify: softmax over the labels (sigmoid for one label).
    normalize: vLLM's older name for use_activation on embeddings. pooling_type: last | mean | cls, None: the
    checkpoint's. truncate_prompt_tokens: keep the prompt's last N tokens (-1: as many as the model takes)."""

    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be a positive integer, got {self.dimensions!r}")
        for name in ("use_activation", "normalize"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"PoolingParams.{name} must be true or false, got {getattr(self, name)!r}")
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"PoolingParams.truncate_prompt_tokens must be a positive integer or -1, got {t!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"PoolingParams.task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")

    def activation(self) -> bool | None:
        """use_activation, else normalize (None: the model's default)."""
        return self.use_activation if self.use_activation is not None else self.normalize

    def clone(self) -> PoolingParams:
        return PoolingParams(**vars(self))
