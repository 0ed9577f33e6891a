"""`_metrics.json`: what is committed (all runs), what this run did, the engine's own metrics, and the run's time
series (batchrun.timeseries, drawn by `batchrun report`)."""

from __future__ import annotations

import logging
from typing import Any

from batchrun.output.drive import RowProducer
from batchrun.output.writer import OrderedWriter

log = logging.getLogger(__name__)


def engine_metrics(producer: RowProducer) -> dict[str, Any]:
    try:
        return producer.metrics()
    except Exception:  # noqa: BLE001 - the metrics file is written whatever the engine's state
        log.warning("the engine metrics are unavailable", exc_info=True)
        return {}


def run_metrics(writer: OrderedWriter, engine: dict[str, Any], about: dict[str, Any], *, wall_s: float,
             complete: bool, series: dict[str, Any] | None = None) -> dict[str, Any]:
    sink = writer.sink
    run = sink.this_run

    def rate(n: int) -> float | None:
        return round(n / wall_s, 2) if wall_s > 0 else None

    return {
        **sink.committed.as_dict(), "complete": complete, "wall_time_s": round(wall_s, 3),
        "generated_tokens_per_s": rate(run.completion_tokens),
        "this_run": {**run.as_dict(), "input_rows": run.inputs,
                     "wall_time_s": round(wall_s, 3), "generated_tokens_per_s": rate(run.completion_tokens),
                     "prompt_tokens_per_s": rate(run.prompt_tokens), "reorder_buffer_peak": writer.peak_buffered},
        "engine": engine, **about, "series": series,
    }


