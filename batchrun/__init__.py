"""batchrun: offline batch LLM inference on a paged KV cache.

The API names are imported lazily, so `batchrun --version` or a bad job file answer without importing torch.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import TYPE_CHECKING


def _others_running() -> int:
    """Processes other than this one running right now: the fewest of five looks at /proc/loadavg's
    runnable count, 2 ms apart (a process that holds a core shows in all five; a blip does not)."""
    counts = []
    for _ in range(5):
        with open("/proc/loadavg") as f:
            counts.append(int(f.read().split()[3].split("/")[0]) - 1)
        time.sleep(0.002)
    return min(counts)


def _openmp_defaults() -> None:
    """How OpenMP threads wait between parallel regions; read by libgomp when torch loads it, so this runs
    before torch is imported. A decode step is dozens of short parallel regions.

    - On a quiet machine, a sleeping worker takes ~100 us (an inter-processor wake in a VM) to start each
      region: measured here, a 1-sequence decode step ran in 6.1 ms with OMP_WAIT_POLICY=PASSIVE and in
      2.7 ms when workers spin for GOMP_SPINCOUNT=10000 iterations (tens of microseconds) before sleeping.
    - On a machine whose cores are already taken, a spinning worker holds a core another process needs:
      with one busy process beside it on 2 cores, the same step took 13 ms with that short spin, 5.3 ms
      passive, 15 ms with unbounded spinning (a whole job once ran 5x slower that way).
    So: passive when other processes are running at start-up, else the short spin. OMP_WAIT_POLICY or
    GOMP_SPINCOUNT in the environment decides instead; BATCHRUN_OMP_DEFAULTS=0 sets nothing.
    """
    if os.environ.get("BATCHRUN_OMP_DEFAULTS", "1") == "0":
        return
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    try:
        busy = _others_running() >= max(1, (os.cpu_count() or 1) // 4)
    except (OSError, ValueError, IndexError):
        busy = True
    if busy:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = "10000"


_openmp_defaults()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "batchrun.llm",
    "EngineArgs": "batchrun.engine_args",
    "SamplingParams": "batchrun.sampling_params",
    "StructuredOutputsParams": "batchrun.sampling_params",
    "RequestOutput": "batchrun.outputs",
    "CompletionOutput": "batchrun.outputs",
    "BeamSearchParams": "batchrun.beam_search",
    "BeamSearchOutput": "batchrun.beam_search",
    "BeamSearchSequence": "batchrun.beam_search",
}
__all__ = ["LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]

if TYPE_CHECKING:
    from batchrun.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from batchrun.engine_args import EngineArgs
    from batchrun.llm import LLM
    from batchrun.outputs import CompletionOutput, RequestOutput
    from batchrun.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
