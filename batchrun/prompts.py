"""Request building for `LLM`: prompts and sampling params checked and tokenized before anything runs, one set of
checks for `generate`, `chat`, `stream` and `beam_search`, each ValueError naming the prompt (`prompts[3]: ...`).
A prompt is vLLM's PromptType (batchrun/inputs.py): text, a TextPrompt or a TokensPrompt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchrun.inputs import UNSUPPORTED_PROMPT_KEYS, PromptType
from batchrun.sampling_params import SamplingParams

PromptInput = PromptType  # str | TextPrompt {"prompt": str} | TokensPrompt {"prompt_token_ids": list[int]}


@dataclass
class PreparedRequest:
    prompt: str | None  # None when given as token ids only
    prompt_token_ids: list[int]
    params: SamplingParams


def tokenize_prompt(tokenizer, vocab_size: int, prompt: PromptInput, where: str) -> tuple[str | None, list[int]]:
    """(text, ids) of one prompt; given ids are checked against the vocabulary (the embedding table's rows)."""
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, dict):
        unsupported = next((k for k in UNSUPPORTED_PROMPT_KEYS if prompt.get(k) is not None), None)
        if unsupported:
            raise ValueError(f"{where}: {unsupported} is not supported: {UNSUPPORTED_PROMPT_KEYS[unsupported]}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
            if any(i < 0 or i >= vocab_size for i in ids):
                raise ValueError(f"{where}: prompt_token_ids has an id outside the vocabulary [0, {vocab_size})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], tokenizer(prompt["prompt"]).input_ids
    raise ValueError(f"{where}: a prompt is a str, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
                     f"got {type(prompt).__name__}")


def prompt_problem(prompt_token_ids: list[int], max_model_len: int, scored: bool = False) -> str | None:
    """None when the prompt can run, else a one-line reason (a row error in a job, a ValueError in the API). A
    scored prompt (`scores_prompt`) may fill max_model_len: it then generates nothing and ends by length."""
    n = len(prompt_token_ids)
    if n == 0:
        return "empty prompt"
    if scored and n > max_model_len:
        return f"prompt has {n} tokens; max_model_len={max_model_len} scores at most {max_model_len}"
    if not scored and n >= max_model_len:
        return f"prompt has {n} tokens, leaving no room to generate within max_model_len={max_model_len}"
    return None



def derive_seed(base: int, index: int) -> int:
    return (base * 0x9E3779B1 + index * 0x85EBCA77 + 1) & ((1 << 62) - 1)


def prepare_requests(prompts: PromptInput | list[PromptInput],
                     sampling_params: SamplingParams | list[SamplingParams] | None,
                     tokenize: Callable[[PromptInput, str], tuple[str | None, list[int]]],
                     check: Callable[[list[int], SamplingParams], str | None]) -> list[PreparedRequest]:
    """Every prompt tokenized and checked (`check`: None or a reason) before any runs."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    sampling_params = list(sampling_params)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params[{i}] is not a SamplingParams")
        text, ids = tokenize(prompt, f"prompts[{i}]")
        reason = check(ids, params)
        if reason:
            raise ValueError(f"prompts[{i}]: {reason}")
        requests.append(PreparedRequest(text, ids, params))
    return requests
