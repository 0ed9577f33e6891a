"""batchrun: offline batch LLM inference on a paged KV cache.

The API names are imported lazily, so `batchrun --version` or a bad job file answer without importing torch.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import TYPE_CHECKING


def _own_running() -> int:
    """This process's threads running right now (state R in /proc/self/task/*/stat)."""
    running = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        running += stat[stat.rindex(")") + 2] == "R"
    return running


def _others_running() -> int:
    """Threads of other processes running right now: the fewest of five looks at /proc/loadavg's runnable count
    less this process's own running threads, 2 ms apart (a process that holds a core shows in all five; a blip
    does not)."""
    counts = []
    for _ in range(5):
        with open("/proc/loadavg") as f:
            runnable = int(f.read().split()[3].split("/")[0])
        counts.append(max(0, runnable - _own_running()))
        time.sleep(0.002)
    return min(counts)


# What _openmp_defaults put into os.environ for this process (empty: nothing). A process started from this one
# inherits it; one that should decide for itself at its own start (a benchmark's worker) is given the environment
# without it.
OPENMP_SET: dict[str, str] = {}


def _openmp_defaults() -> None:
    """How OpenMP workers wait between parallel regions, set before torch loads libgomp: passive when other
    processes run at start-up (a spinning worker would hold a core they need), else a short spin (a sleeping
    worker is slow to wake for each of a step's many short regions). docs/cpu-kernels.md: Threads."""
    if os.environ.get("BATCHRUN_OMP_DEFAULTS", "1") == "0":
        return
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    try:
        busy = _others_running() >= max(1, (os.cpu_count() or 1) // 4)
    except (OSError, ValueError, IndexError):
        busy = True
    OPENMP_SET.update({"OMP_WAIT_POLICY": "PASSIVE"} if busy else {"GOMP_SPINCOUNT": "10000"})
    os.environ.update(OPENMP_SET)


_openmp_defaults()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "batchrun.llm",
    "EngineArgs": "batchrun.engine_args",
    "SamplingParams": "batchrun.sampling_params",
    "StructuredOutputsParams": "batchrun.sampling_params",
    "RequestOutput": "batchrun.outputs",
    "CompletionOutput": "batchrun.outputs",
    "Logprob": "batchrun.outputs",
    "TokensPrompt": "batchrun.inputs",
    "TextPrompt": "batchrun.inputs",
    "PromptType": "batchrun.inputs",
    "LoRARequest": "batchrun.inputs",
    "BeamSearchParams": "batchrun.beam_search",
    "BeamSearchOutput": "batchrun.beam_search",
    "BeamSearchSequence": "batchrun.beam_search",
    "PoolingParams": "batchrun.pooling_params",
    "PoolingRequestOutput": "batchrun.outputs",
    "EmbeddingRequestOutput": "batchrun.outputs",
    "ClassificationRequestOutput": "batchrun.outputs",
    "ScoringRequestOutput": "batchrun.outputs",
}
__all__ = ["LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "TokensPrompt", "TextPrompt", "PromptType", "LoRARequest", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "PoolingParams", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "__version__"]

if TYPE_CHECKING:
    from batchrun.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from batchrun.engine_args import EngineArgs
    from batchrun.inputs import LoRARequest, PromptType, TextPrompt, TokensPrompt
    from batchrun.llm import LLM
    from batchrun.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from batchrun.pooling_params import PoolingParams
    from batchrun.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
