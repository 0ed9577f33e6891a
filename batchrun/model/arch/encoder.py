"""What every encoder family shares: the loader's interface (loader.load_model builds, fills and prepares it as it
does a CausalLM), where each checkpoint tensor goes, and the pooling attributes the encoder runner reads. Encoders
keep no KV cache: a forward takes whole packed sequences."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

# the base model's attribute in transformers' task models (and in sentence-transformers folders saved from them)
BASE_PREFIXES = ("bert.", "roberta.", "model.")
# parameter names older checkpoints give LayerNorms
LEGACY_SUFFIXES = {"gamma": "weight", "beta": "bias"}


def is_classifier(config: PretrainedConfig) -> bool:
    """A `*ForSequenceClassification` checkpoint: it has a classification head."""
    archs = getattr(config, "architectures", None) or [""]
    return archs[0].endswith("ForSequenceClassification")


class Encoder(nn.Module):
    """A bidirectional encoder: forward(input_ids, positions, seq_starts) -> the last hidden states, packed.

    Where checkpoint tensors go, by module (the base model's prefix removed): `layer_pattern` finds layer i's
    modules, `layer_modules` maps each to (ours, part), a fused module's part p starting at row p * hidden_size;
    `other_modules` maps the rest (None: no place here, skipped). Families define forward and pool_head."""

    is_encoder = True
    layer_pattern = re.compile(r"^layers\.(\d+)\.(.+)$")
    layer_modules: dict[str, tuple[str, int]] = {}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = int(config.hidden_size)
        self.has_head = is_classifier(config)
        self.num_labels = int(config.num_labels) if self.has_head else 0
        self.default_pooling = "cls"
        self.other_modules: dict[str, str | None] = {}

    # ---- what loader.load_model calls ----

    def tie_weights(self) -> None:
        """Nothing is tied: the heads here take no weight of the embeddings."""

    def finish_load(self) -> None:
        """Nothing to fold after the weights are in."""

    def prepare(self, max_pos: int) -> None:
        """After the weights are in, cast and placed (rotary tables, position checks): the family's."""

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]]
                           ) -> Iterable[tuple[str, Callable[[], torch.Tensor]]]:
        return tensors

    def weight_target(self, name: str) -> tuple[str, int] | None:
        """(our parameter, first row) of checkpoint tensor `name`; None where it has no place here. A name neither
        table knows comes back as it is, so that the loader names it in its error."""
        for prefix in BASE_PREFIXES:
            if name.startswith(prefix):
                name = name.removeprefix(prefix)
                break
        module, _, suffix = name.rpartition(".")
        suffix = LEGACY_SUFFIXES.get(suffix, suffix)
        layer = self.layer_pattern.match(module)
        if layer is not None and layer.group(2) in self.layer_modules:
            ours, part = self.layer_modules[layer.group(2)]
            return f"layers.{layer.group(1)}.{ours}.{suffix}", part * self.hidden_size
        if module in self.other_modules:
            ours = self.other_modules[module]
            return None if ours is None else (f"{ours}.{suffix}", 0)
        return name, 0

    # ---- what the encoder runner reads ----

    def pool_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """[n, hidden] pooled vectors -> [n, num_labels] logits: the family's classification head."""
        raise ValueError(f"this {self.config.model_type} checkpoint is a bare encoder: it has no classification head")

    @property
    def classifier(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """pool_head where there is a head, else None (the name the causal models' runner reads)."""
        return self.pool_head if self.has_head else None
