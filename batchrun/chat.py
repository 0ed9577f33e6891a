"""Chat templating for `LLM.chat` (a job's rows: io/rows.py); a bad conversation is a ValueError naming it."""

from __future__ import annotations

from typing import Any

Conversation = list[dict[str, Any]]


def render_conversations(tokenizer, messages: Conversation | list[Conversation], *, model_path: Any,
                         chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                         add_generation_prompt: bool = True,
                         continue_final_message: bool = False) -> list[dict[str, Any]]:
    """One {"prompt", "prompt_token_ids"} per conversation, tokenized without adding special tokens again."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a conversation ([{'role': ..., 'content': ...}, ...]) or a "
                         "non-empty list of them")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model_path} has no chat template: pass chat_template=")
    prompts = []
    for i, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in conversation):
            raise ValueError(f"messages[{i}]: a conversation is a non-empty list of {{'role', 'content'}} dicts")
        text = tokenizer.apply_chat_template(
            list(conversation), tokenize=False, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}))
        prompts.append({"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
    return prompts
