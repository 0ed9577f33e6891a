"""The server's own settings (the engine's are batchrun.config.EngineSettings)."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.serve import shapes


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no key asked
    # how often a running batch commits its finished lines: what a kill -9 can lose, and how fresh the
    # batch's request_counts are
    commit_interval_s: float = 1.0
    max_file_bytes: int = shapes.MAX_FILE_BYTES
    max_requests: int = shapes.MAX_REQUESTS
    completion_window_s: int = shapes.COMPLETION_WINDOW_S  # "24h"; shorter only in tests of expiry
