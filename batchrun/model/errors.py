"""Errors of the model layer, in a module of their own so that every model module can raise them
without importing the loader (which imports the model code)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model cannot be loaded (missing path, unsupported architecture, bad checkpoint)."""


class InsufficientMemoryError(ModelLoadError):
    """The model and its KV cache do not fit the memory this machine has available (raised before loading:
    batchrun.model.runner.memory)."""
