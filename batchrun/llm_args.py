"""vLLM's constructor arguments, as data: `LLM(model, **kwargs)` reads them through `engine_args`, and
docs/gen_python_api.py writes docs/python-api.md's table from them.

An argument is one of: an EngineArgs field (batchrun's own settings, several under vLLM's names: SHARED), renamed
to one (RENAMED), or an argument with nothing to do here (INERT): accepted at the values that change nothing, else
refused in one line naming it and why. Any setting given None takes its default, as vLLM's None does. Anything
else is refused as unknown."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import Any

from batchrun.engine_args import EngineArgs, EngineArgsError
from batchrun.inputs import TOKENIZER_MODES

# EngineArgs fields that vLLM's LLM also takes, under the same name: how batchrun honours each.
SHARED: dict[str, str] = {
    "tokenizer": "another tokenizer: a folder, `builtin:NAME`, a `.gguf` file or a Hub id in the local cache",
    "revision": "the snapshot of a Hub id read from the local Hugging Face cache",
    "tokenizer_revision": "the same for the tokenizer; None: `revision`",
    "trust_remote_code": "passed to transformers' AutoConfig and AutoTokenizer",
    "seed": "the base of the seeds of requests without their own; None: 0",
    "dtype": "the weights' dtype; also vLLM's spellings `float` and `half`, and a torch.dtype",
    "max_model_len": "the longest prompt + completion; None: the model's own limit",
    "quantization": "None: `none`; batchrun's methods are int8, int4, int4-g32 and gguf (docs/quantization.md)",
    "device": "where the model runs: `auto`, `cpu`, `cuda`, `cuda:N`",
    "gpu_memory_utilization": "CUDA: the share of the GPU's memory the engine may take; unused on a CPU",
    "swap_space": "a number below 1024 is GiB, as vLLM means it (4: 4 GiB); a larger one bytes, a string a size",
    "kv_cache_dtype": "how the KV cache stores keys and values; vLLM's `fp8` is `fp8_e4m3`",
    "max_num_seqs": "the most sequences in one step; None: the default",
    "max_num_batched_tokens": "the most tokens one step computes; None: the default",
    "block_size": "tokens per KV block; None: the default",
    "enable_prefix_caching": "prompts sharing a prefix compute it once; None: on",
    "enforce_eager": "CUDA: no CUDA graphs",
    "runner": "`pooling`: the LLM pools only (generation refused), with a KV pool for the prompts in flight and no "
              "copies of weights that only generation reads; `auto`, `generate`: it generates and pools (as `task`, "
              "vLLM's `embed`, `classify`, `score`, `reward` are `pooling`)",
}

# vLLM's names of EngineArgs fields that batchrun names otherwise.
RENAMED: dict[str, str] = {"kv_cache_memory_bytes": "kv_cache_memory", "task": "runner"}

# vLLM's spellings of a value.
VALUE_ALIASES: dict[str, dict[Any, Any]] = {"kv_cache_dtype": {"fp8": "fp8_e4m3"},
                                            "runner": {task: "pooling" for task in ("embed", "classify", "score",
                                                                                     "reward")}}

GIB = 2**30
# swap_space numbers below this are GiB (vLLM's unit); no byte count this small holds a KV block
SWAP_GIB_BELOW = 1024


class _Any:
    def __repr__(self) -> str:
        return "any value"


ANY = _Any()


@dataclass(frozen=True)
class Inert:
    """A vLLM argument with nothing to do here: `accepted` values (or ANY) change nothing, any other is refused."""

    accepted: tuple | _Any
    why: str  # why the accepted values change nothing, and why the others are refused

    def accepts(self, value: Any) -> bool:
        return self.accepted is ANY or any(_same(value, a) for a in self.accepted)


def _same(value: Any, accepted: Any) -> bool:
    """Equal and of the same kind: True is not 1, 1.0 is 1."""
    if value is None or accepted is None or isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    if isinstance(accepted, (int, float)):
        return isinstance(value, (int, float)) and value == accepted
    return type(value) is type(accepted) and value == accepted


_ONE_ENGINE = "one engine per process here; for more replicas use executor: ray (docs/cluster.md)"
_LORA = "LoRA adapters are not supported yet: merge the adapter into the checkpoint (peft's merge_and_unload)"
_NO_DOWNLOAD = "nothing is downloaded: a Hub id is read from the local Hugging Face cache (HF_HUB_CACHE)"
_TEXT_ONLY = "batchrun runs text-only models"

INERT: dict[str, Inert] = {
    "tensor_parallel_size": Inert((1, None), _ONE_ENGINE),
    "pipeline_parallel_size": Inert((1, None), _ONE_ENGINE),
    "data_parallel_size": Inert((1, None), _ONE_ENGINE),
    "distributed_executor_backend": Inert((None, "uni", "mp"), _ONE_ENGINE),
    "disable_custom_all_reduce": Inert(ANY, "one device: there is no all-reduce"),
    "enable_lora": Inert((False, None), _LORA),
    "max_lora_rank": Inert(ANY, "used only with enable_lora"),
    "max_loras": Inert(ANY, "used only with enable_lora"),
    "max_cpu_loras": Inert(ANY, "used only with enable_lora"),
    "tokenizer_mode": Inert(TOKENIZER_MODES, "batchrun loads the tokenizer transformers' AutoTokenizer picks"),
    "skip_tokenizer_init": Inert((False, None), "batchrun needs the tokenizer (stop strings, chat templates, text)"),
    "disable_log_stats": Inert(ANY, "batchrun logs no periodic stats: LLM.metrics() has the counters"),
    "cpu_offload_gb": Inert((0, None), "the weights stay on the device that runs them; quantization shrinks them "
                                       "(docs/quantization.md)"),
    "hf_token": Inert(ANY, _NO_DOWNLOAD),
    "download_dir": Inert((None,), _NO_DOWNLOAD),
    "load_format": Inert((None, "auto", "safetensors", "gguf"), "batchrun reads safetensors and GGUF checkpoints"),
    "logits_processors": Inert((None, []), "logits processors are not supported"),
    "max_seq_len_to_capture": Inert(ANY, "batchrun's CUDA graphs cover decode steps up to max_model_len "
                                         "(enforce_eager turns them off)"),
    "compilation_config": Inert((None, 0, {}), "batchrun uses no torch.compile; enforce_eager turns its CUDA "
                                               "graphs off"),
    "enable_chunked_prefill": Inert((None, True), "a prompt longer than max_num_batched_tokens is always prefilled "
                                                  "in chunks: set max_num_batched_tokens >= max_model_len to "
                                                  "prefill each whole"),
    "max_logprobs": Inert(ANY, "a request gets as many log-probabilities as it asks"),
    "disable_async_output_proc": Inert(ANY, "outputs are made within the engine's step"),
    "speculative_config": Inert((None,), "speculative decoding here is prompt lookup: num_speculative_tokens"),
    "limit_mm_per_prompt": Inert((None, {}), _TEXT_ONLY),
    "mm_processor_kwargs": Inert((None, {}), _TEXT_ONLY),
    "hf_overrides": Inert((None, {}), "the checkpoint's config is used as it is"),
    "calculate_kv_scales": Inert((None, False), "an fp8 KV cache here is cast without scales (docs/kv-cache.md)"),
    "enable_sleep_mode": Inert((None, False), "no sleep mode: free the model with `del llm`"),
    "num_scheduler_steps": Inert((None, 1), "the engine schedules every step"),
    "use_v2_block_manager": Inert(ANY, "batchrun has one block manager"),
    "served_model_name": Inert(ANY, "the offline API serves no model"),
    "max_parallel_loading_workers": Inert(ANY, "the weights load in this process, one tensor at a time"),
    "model_impl": Inert((None, "auto"), "batchrun runs its own code for each family (docs/models.md)"),
    "enable_prompt_embeds": Inert((None, False), "prompts are text or token ids here"),
}

_FIELDS = {f.name: f for f in fields(EngineArgs)}


def swap_space_bytes(value: Any) -> Any:
    """vLLM's swap_space is GiB: a number below SWAP_GIB_BELOW is taken as GiB, anything else as batchrun's size."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < SWAP_GIB_BELOW:
        return int(value * GIB)
    return value


def _nullable(name: str) -> bool:
    return _FIELDS[name].metadata["rule"].nullable


def _unknown(name: str) -> EngineArgsError:
    known = [*_FIELDS, *RENAMED, *INERT]
    near = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else " (docs/python-api.md lists what LLM takes)"
    return EngineArgsError(name, f"LLM() got an unexpected keyword argument: neither a batchrun setting nor one of "
                                 f"vLLM's it knows{hint}")


def settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """EngineArgs keyword arguments from LLM's (vLLM's or batchrun's names); EngineArgsError (a ValueError naming the
    argument) for an argument refused or unknown."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in INERT:
            inert = INERT[name]
            if not inert.accepts(value):
                raise EngineArgsError(name, f"{value!r} is not supported: {inert.why}")
            continue
        target = RENAMED.get(name, name)
        if target != name and target in kwargs:
            raise EngineArgsError(name, f"give {name} or {target}, not both")
        if target not in _FIELDS or target == "model":
            raise _unknown(name)
        try:
            value = VALUE_ALIASES.get(target, {}).get(value, value)
        except TypeError:  # an unhashable value: the field's rule answers for it
            pass
        if target == "swap_space":
            value = swap_space_bytes(value)
        if value is None and not _nullable(target):
            continue  # vLLM's None: the setting's default
        out[target] = value
    return out


def engine_args(model: str | EngineArgs, kwargs: dict[str, Any]) -> EngineArgs:
    """The settings of `LLM(model, **kwargs)`: `model` a path (or EngineArgs whole, which kwargs then change)."""
    values = settings(kwargs)
    if isinstance(model, EngineArgs):
        return dataclasses.replace(model, **values) if values else model
    return EngineArgs(model, **values)
