"""batchrun: offline batch LLM inference on a paged KV cache.

The API names are imported lazily, so `batchrun --version` or a bad job file answer without importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# OpenMP threads that spin while waiting lose their core whenever anything else runs on the machine (a
# shared cluster node, a CI runner), and every parallel region then waits a scheduler tick: measured here,
# a whole job ran 5x slower. Sleeping waits cost a little on an idle machine and nothing like that on a
# busy one. Set before torch starts OpenMP; OMP_WAIT_POLICY=ACTIVE in the environment overrides it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "batchrun.llm",
    "SamplingParams": "batchrun.sampling_params",
    "RequestOutput": "batchrun.outputs",
    "CompletionOutput": "batchrun.outputs",
    "BeamSearchParams": "batchrun.beam_search",
    "BeamSearchOutput": "batchrun.beam_search",
    "BeamSearchSequence": "batchrun.beam_search",
}
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]

if TYPE_CHECKING:
    from batchrun.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from batchrun.llm import LLM
    from batchrun.outputs import CompletionOutput, RequestOutput
    from batchrun.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
