"""How a checkpoint pools: sentence-transformers' modules.json and its Pooling and Normalize modules when present,
else the model's own default (last token for decoders)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.model.errors import ModelLoadError

# sentence-transformers' Pooling config: its `pooling_mode` values, and the older per-mode flags (the first set wins)
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass
class PoolingConfig:
    pooling_type: str  # last | mean | cls
    normalize: bool  # L2-normalise embeddings by default
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' named instruction prefixes
    default_prompt_name: str | None = None
    from_sentence_transformers: bool = False


def read_pooling_config(path: Path, default_type: str) -> PoolingConfig:
    """The checkpoint folder's pooling; `default_type` where it says none. Without sentence-transformers' files
    embeddings are normalised (vLLM's default)."""
    path = Path(path)
    modules = _json(path / "modules.json") if path.is_dir() else None
    if not isinstance(modules, list):
        return PoolingConfig(default_type, True)
    pooling_type, normalize = default_type, False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            settings = _json(path / str(module.get("path", "")) / "config.json") or {}
            mode = settings.get("pooling_mode")
            if mode is not None and mode not in _ST_MODES:
                raise ModelLoadError(f"{path.name}: sentence-transformers pooling {mode!r} is not supported (batchrun "
                                     f"pools by {', '.join(_ST_MODES)})")
            pooling_type = _ST_MODES[mode] if mode is not None else next(
                (m for key, m in _ST_FLAGS.items() if settings.get(key)), default_type)
        elif kind.endswith("Normalize"):
            normalize = True
    extra = _json(path / "config_sentence_transformers.json") or {}
    prompts = extra.get("prompts") if isinstance(extra.get("prompts"), dict) else {}
    return PoolingConfig(pooling_type, normalize, {str(k): str(v) for k, v in prompts.items()},
                         extra.get("default_prompt_name"), True)


def _json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None
