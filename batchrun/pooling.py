"""LLM's pooling tasks: what a loaded model can pool, each request's PoolingState for the engine, and the vector
the engine pools made into the task's answer by the request's PoolingParams (normalised, truncated, activated)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchrun.engine.pooling import PoolingState
from batchrun.model.weights.pooling_config import PoolingConfig
from batchrun.pooling_params import PoolingParams
from batchrun.sampling_params import SamplingParams

# a pooled request's sampling params in the engine: it computes its prompt and generates nothing
POOLED = SamplingParams(max_tokens=0, detokenize=False)


@dataclass(frozen=True)
class PoolingModel:
    """What the loaded model pools with: its checkpoint's pooling, its classifier's labels (None: no head), and
    whether it is an encoder (bidirectional: it pools only, each prompt whole) or generates too."""

    config: PoolingConfig
    num_labels: int | None
    is_encoder: bool
    generates: bool

    def tasks(self) -> tuple[str, ...]:
        own = ("generate",) if self.generates else ()
        if self.num_labels is None:
            return own + ("embed", "score", "encode")
        return own + ("classify", "reward", "encode", "embed") + (("score",) if self.num_labels == 1 else ())

    def scores_by_head(self) -> bool:
        """score: a cross-encoder's one-label head over the pair, else the cosine of two embeddings."""
        return self.num_labels == 1

    def check(self, task: str) -> None:
        if task not in self.tasks():
            what = f"a classifier with {self.num_labels} labels" if self.num_labels else "an embedding model"
            raise ValueError(f"task {task!r}: this model is {what} and runs {', '.join(self.tasks())}")

    def state(self, task: str, params: PoolingParams) -> PoolingState:
        """The engine's pooling of one request: the classifier runs on its pooled vector for classify / reward /
        a cross-encoder's score."""
        head = task in ("classify", "reward") or (task == "score" and self.scores_by_head())
        mode = params.pooling_type or self.config.pooling_type
        if head and mode == "mean" and not self.is_encoder:
            raise ValueError("a decoder's classifier pools the last token: pooling_type mean does not apply")
        return PoolingState(mode, head)

    def finish(self, task: str, params: PoolingParams, vector: list[float]) -> list[float]:
        """The answer of `task` from the pooled vector: an embedding (dimensions, then L2 normalisation unless
        use_activation is false), class probabilities (softmax; sigmoid for one label) or raw logits (reward, and
        classify with use_activation false)."""
        activate = params.activation()
        embedding = task == "embed" or (task == "encode" and self.num_labels is None)
        if embedding:
            if params.dimensions is not None:
                if params.dimensions > len(vector):
                    raise ValueError(f"dimensions={params.dimensions} exceeds the model's {len(vector)}")
                vector = vector[: params.dimensions]
            if self.config.normalize if activate is None else activate:
                norm = math.sqrt(math.fsum(v * v for v in vector)) or 1.0
                vector = [v / norm for v in vector]
            return vector
        if task == "reward" or activate is False:
            return vector
        return softmax(vector)


def truncate(ids: list[int], params: PoolingParams, max_model_len: int) -> list[int]:
    """truncate_prompt_tokens: the prompt's last N tokens (-1: the last max_model_len)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def softmax(logits: list[float]) -> list[float]:
    """Class probabilities: softmax over the labels, the sigmoid of a one-label head."""
    if len(logits) == 1:
        return [1.0 / (1.0 + math.exp(-logits[0]))]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = math.fsum(exps)
    return [e / total for e in exps]


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0
