"""The model layer's errors, apart so that any model module can raise them without importing the loader."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model cannot be loaded (missing path, unsupported architecture, bad checkpoint)."""


class InsufficientMemoryError(ModelLoadError):
    """The model and its KV cache do not fit the memory available (raised before loading: runner/memory.py)."""
