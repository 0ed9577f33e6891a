"""A run's coarse time series (`_metrics.json` "series", drawn by `batchrun report`): a point every
BATCHRUN_SERIES_INTERVAL seconds (metrics read only then); past MAX_POINTS every other goes, the interval doubles."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

INTERVAL_ENV = "BATCHRUN_SERIES_INTERVAL"
MAX_POINTS = 1000
COLUMNS = ("t_s", "rows_done", "generated_tokens", "running", "waiting", "swapped", "kv_blocks_in_use",
           "preemptions")


class TimeSeries:
    def __init__(self, *, interval: float | None = None, start: float | None = None) -> None:
        self.interval = interval if interval is not None else float(os.environ.get(INTERVAL_ENV, "5"))
        self.t0 = time.monotonic() if start is None else start
        self.last: float | None = None
        self.points: list[tuple[float | int, ...]] = []
        self.kv_blocks_total = 0

    def maybe_sample(self, now: float, rows_done: int, metrics: Callable[[], dict[str, Any]],
                     rows_tokens: int = 0) -> None:
        if self.last is None or now - self.last >= self.interval:
            try:
                m = metrics()
            except Exception:  # noqa: BLE001 - a picture of the run must never break it
                return
            self.sample(now, rows_done, m, rows_tokens)

    def sample(self, now: float, rows_done: int, m: dict[str, Any], rows_tokens: int = 0) -> None:
        """Record a point now; `rows_tokens` (finished rows' tokens) stands in for an engine that counts none."""
        self.last = now
        self.kv_blocks_total = int(m.get("kv_blocks_total") or self.kv_blocks_total)
        tokens = m.get("generation_tokens")
        self.points.append((
            round(now - self.t0, 3), int(rows_done), int(tokens if tokens is not None else rows_tokens),
            int(m.get("num_running", 0)), int(m.get("num_waiting", 0)), int(m.get("num_swapped", 0)),
            int(m.get("kv_blocks_in_use", m.get("kv_blocks_used", 0))),
            int(m.get("num_preemptions_recompute", 0)) + int(m.get("num_preemptions_swap", 0)),
        ))
        if len(self.points) > MAX_POINTS:
            self.points = [*self.points[:-1:2], self.points[-1]]  # the newest point always stays
            self.interval *= 2

    def as_dict(self) -> dict[str, Any]:
        columns = list(zip(*self.points)) if self.points else [()] * len(COLUMNS)
        return {"interval_s": self.interval, "kv_blocks_total": self.kv_blocks_total,
                **{name: list(values) for name, values in zip(COLUMNS, columns)}}

    def finish(self, rows_done: int, m: dict[str, Any], rows_tokens: int = 0) -> dict[str, Any]:
        self.sample(time.monotonic(), rows_done, m, rows_tokens)
        return self.as_dict()
