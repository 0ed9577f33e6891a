"""Where batchrun keeps what it makes on first use (built-in models, compiled CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$BATCHRUN_CACHE, default ~/.cache/batchrun."""
    return Path(os.environ.get("BATCHRUN_CACHE", "~/.cache/batchrun")).expanduser()
