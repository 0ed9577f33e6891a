"""batchrun: offline batch LLM inference on a paged KV cache."""

from batchrun.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from batchrun.llm import LLM
from batchrun.outputs import CompletionOutput, RequestOutput
from batchrun.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "__version__"]
