"""LLM: the Python API (vLLM's offline names). CONTRACT STUB: being implemented; signatures are final."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from batchrun.outputs import RequestOutput
from batchrun.sampling_params import SamplingParams

PromptInput = Any  # str | {"prompt": str} | {"prompt_token_ids": list[int]}


class LLM:
    def __init__(self, model: str, *, dtype: str = "auto", device: str = "auto", block_size: int = 16,
                 kv_cache_memory: int | str | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, swap_space: int | str = 0,
                 preemption_mode: str = "auto", enable_prefix_caching: bool = True,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 4096,
                 max_model_len: int | None = None, seed: int = 0, attention_backend: str = "auto",
                 enforce_eager: bool = False) -> None:
        raise NotImplementedError

    # the HF fast tokenizer of the model (PreTrainedTokenizerFast)
    tokenizer: Any
    # the longest prompt + completion the engine accepts
    max_model_len: int

    def generate(self, prompts: PromptInput | list[PromptInput],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """All outputs, in input order."""
        raise NotImplementedError

    def stream(self, items: Iterable[tuple[Any, PromptInput, SamplingParams]], *,
               max_in_flight: int = 1024) -> Iterator[tuple[Any, RequestOutput]]:
        """Pull (key, prompt, params) lazily, keep at most max_in_flight requests in the engine, and yield
        (key, finished RequestOutput) in completion order. Raises ValueError for a prompt that cannot
        run (empty, too long): callers that want row errors check first with `check_prompt`."""
        raise NotImplementedError

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> str | None:
        """None when the prompt can run, else a one-line reason (empty, too long for max_model_len)."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float | int]:
        raise NotImplementedError
