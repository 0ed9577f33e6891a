"""Rows of a pooling job (task: embed, classify, score) -> pooled requests: the prompt (or a score's pair) with the
job's prefix, tokenized, fitted to the model by input.on_too_long, and the engine task that answers it."""

from __future__ import annotations

from typing import Any

from batchrun.io.row_task import RowTask, text_problem
from batchrun.io.sources import Row


def build_pooled(builder: Any, items: list[tuple[int, int, Row]]) -> list[RowTask]:
    """builder: the job's io.rows.RequestBuilder (its tokenizer, checks and text reading)."""
    cfg, inp = builder.cfg, builder.inp
    params = cfg.pooling_params()
    if cfg.task == "classify":  # the row keeps the logits; the output adds their probabilities
        params.use_activation = False
    prefix = _prefix(cfg.pooling["prefix"] or "", builder.pooling)
    score = cfg.task == "score"
    by_head = score and builder.pooling is not None and builder.pooling.scores_by_head()
    engine_task = "score" if by_head else "embed" if score else cfg.task
    tasks: list[RowTask] = []
    texts: list[tuple[RowTask, str, str | None, bool]] = []  # (task, text, second text, add special tokens)
    for pos, index, row in items:
        task = builder.row_task(pos, index, row)
        tasks.append(task)
        if task.error is not None:
            continue
        if score:
            first, second = inp["text_1_column"], inp["text_2_column"]
            task.error = text_problem(row, first) or text_problem(row, second)
            if task.error is None:
                task.prompt = prefix + row[first]
                texts.append((task, task.prompt, prefix + row[second], True))
        else:
            text, special = builder._text(row, task)
            if task.error is None and text is not None:
                task.prompt = prefix + text
                texts.append((task, task.prompt, None, special))
        task.pooling = (engine_task, params)
    tokenizer = builder.tokenizer
    for special in (True, False):
        group = [t for t in texts if t[3] is special]
        if not group:
            continue
        if by_head:  # a cross-encoder reads the pair as one prompt, the tokenizer's separators between
            ids = tokenizer([t[1] for t in group], [t[2] for t in group])["input_ids"]
            seconds = [None] * len(group)
        else:
            ids = tokenizer([t[1] for t in group], add_special_tokens=special)["input_ids"]
            seconds = tokenizer([t[2] for t in group])["input_ids"] if score else [None] * len(group)
        for (task, _, _, _), first_ids, second_ids in zip(group, ids, seconds):
            task.prompt_ids = _fit(builder, task, list(first_ids))
            if task.runs and second_ids is not None:
                task.more_ids = [_fit(builder, task, list(second_ids))]
            if task.runs:
                task.prompt_tokens = len(task.prompt_ids) + sum(map(len, task.more_ids or ()))
    for task in tasks:
        if not task.runs:
            task.prompt_ids = task.more_ids = task.pooling = None
    return tasks


def _prefix(prefix: str, pooling: Any) -> str:
    """pooling.prefix: the text itself, or `prompt_name:NAME` for a sentence-transformers prompt of the checkpoint."""
    if not prefix.startswith("prompt_name:"):
        return prefix
    name = prefix.removeprefix("prompt_name:")
    prompts = pooling.config.prompts if pooling is not None else {}
    if name not in prompts:
        from batchrun.config import JobError

        raise JobError(f"pooling.prefix: the model has no sentence-transformers prompt {name!r} (it has "
                       f"{', '.join(prompts) or 'none'})")
    return prompts[name]


def _fit(builder: Any, task: RowTask, ids: list[int]) -> list[int]:
    """The prompt within max_model_len by input.on_too_long (error, skip, or cut, keeping the special tokens at
    its ends: an encoder's CLS and SEP, a decoder's BOS and EOS); sets the row's error or skip."""
    why = builder.check_prompt(ids, True)
    limit = builder.max_model_len
    if not why or limit is None or len(ids) <= limit or builder.on_too_long == "error":
        task.error = task.error or why
        return ids
    if builder.on_too_long == "skip":
        task.skipped = f"{why} (input.on_too_long: skip)"
        return ids
    special = set(getattr(builder.tokenizer, "all_special_ids", ()) or ())
    head = ids[:1] if ids[0] in special else []
    tail = ids[-1:] if ids[-1] in special and len(ids) > 1 else []
    room = limit - len(head) - len(tail)
    body = ids[len(head) : len(ids) - len(tail)]
    body = body[:room] if builder.on_too_long == "truncate_right" else body[len(body) - room :]
    cut = head + body + tail
    task.truncated = (task.truncated or 0) + len(ids) - len(cut)
    task.error = builder.check_prompt(cut, True)
    return cut
