"""A peer's worker process around its task: read the spec, run the task, write the result with the process's
figures. Standard library and the harness's clock only: it runs in the peer's venv, without batchrun."""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.clock import Result, peak_rss_mb


def main(argv: list[str], task: str, run: Callable[[dict[str, Any]], Result]) -> int:
    """`python -m <peer's worker> SPEC RESULT`: `run(spec)`, written to RESULT as the orchestrator reads it."""
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore")
    t = time.perf_counter()
    result = run(spec)
    # the threads the engine reports using (vLLM's torch threads), else those the spec gave
    result.update(task=task, threads=result.get("torch_threads", spec.get("threads", 2)), peak_rss_mb=peak_rss_mb(),
                  process_s=time.perf_counter() - t)
    out_path.write_text(json.dumps(result, default=str))
    return 0
