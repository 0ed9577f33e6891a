"""vLLM's input names: the prompt shapes `generate` takes (`TokensPrompt`, `TextPrompt`, `PromptType`) and
`LoRARequest`, which is refused where it is used (batchrun runs no adapters)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict, Union

try:  # Python 3.11+
    from typing import NotRequired
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized with the model's tokenizer."""

    prompt: str
    cache_salt: NotRequired[str]  # vLLM's prefix-cache salt: accepted, the cache is shared only by equal prompts


class TokensPrompt(TypedDict):
    """A prompt given as token ids, run as they are (no special token added)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text shown in RequestOutput.prompt
    cache_salt: NotRequired[str]


# What `LLM.generate` takes for one prompt: text, or one of the two dicts above.
PromptType = Union[str, TextPrompt, TokensPrompt]

# vLLM's tokenizer modes batchrun takes (LLM's tokenizer_mode, get_tokenizer's): both mean the tokenizer
# transformers' AutoTokenizer picks, which is the one batchrun loads.
TOKENIZER_MODES = ("auto", "hf")

# vLLM's prompt keys for inputs a text model cannot take: refused when set, never dropped silently.
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": "batchrun runs text-only models",
    "mm_processor_kwargs": "batchrun runs text-only models",
    "multi_modal_uuids": "batchrun runs text-only models",
    "prompt_embeds": "prompts are text or token ids here, not embeddings",
    "token_type_ids": "token type ids belong to encoder models, which batchrun does not run",
}


@dataclass
class LoRARequest:
    """vLLM's adapter request (`vllm.lora.request.LoRARequest`). batchrun runs no adapters yet: `generate` and
    `chat` refuse one (`check_lora_request`); merge the adapter into the checkpoint instead."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def check_lora_request(lora_request: Any) -> None:
    """None (or a list of Nones) passes; an adapter is refused in one line."""
    requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    given = next((r for r in requests if r is not None), None)
    if given is None:
        return
    name = getattr(given, "lora_name", None) or type(given).__name__
    raise ValueError(f"lora_request: LoRA adapters are not supported yet ({name!r}); merge the adapter into the "
                     "checkpoint (peft's merge_and_unload) and load that")
