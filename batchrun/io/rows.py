"""Input rows -> engine requests (RowTask). A row that cannot become one (a bad prompt, messages or sampling value,
a prompt too long) becomes a RowTask with `error` set, and never reaches the engine. A `task: loglikelihood` row
(context, continuation) becomes a request for its prompt's log-probabilities alone (`RowTask.score`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from batchrun.config import POOLED_TASKS, JobConfig, JobError, check_sampling_value, sampling_error
from batchrun.io.openai_pooling import pooled_request
from batchrun.io.pooled_rows import build_pooled
from batchrun.io.row_task import RowTask, text_problem
from batchrun.io.sources import ROW_ERROR, Row
from batchrun.sampling_params import STRUCTURED_KINDS, SamplingParams, scores_prompt

log = logging.getLogger(__name__)

_INT_FIELDS = {"n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs"}


class RequestBuilder:
    def __init__(self, cfg: JobConfig, *, source_format: str, tokenizer: Any,
                 check_prompt: Callable[[list[int], bool], str | None],
                 id_column: str | None,
                 check_structured: Callable[[SamplingParams], str | None] | None = None,
                 max_model_len: int | None = None, pooling: Any = None) -> None:
        self.cfg = cfg
        self.inp = cfg.input
        self.on_too_long = cfg.input.get("on_too_long", "error")
        self.max_model_len = max_model_len  # None: prompts are not cut (on_too_long acts as error)
        self.pooling = pooling  # the engine's batchrun.pooling.PoolingModel (pooling tasks)
        self.openai = source_format == "openai-batch"
        self.tokenizer = tokenizer
        self.check_prompt = check_prompt
        self.check_structured = check_structured  # None: the engine has no structured outputs to check
        self.id_column = id_column
        self.messages_column = self.inp["messages_column"]
        self.prompt_column = self.inp["prompt_column"]
        self.task = cfg.task
        self.base = dict(cfg.sampling)
        self.base_seed = self.base.get("seed")
        needs_template = bool(self.messages_column) or self.openai
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.messages_column and not self.has_template:
            raise JobError(f"input.messages_column: the tokenizer of {cfg.model['path']} has no chat template")
        if needs_template and not self.has_template:
            log.warning("the tokenizer has no chat template: chat rows will be errors")

    def columns(self) -> list[str] | None:
        """The input columns a row needs (None: all, for formats that cannot select)."""
        return input_columns(self.cfg, "openai-batch" if self.openai else "", self.id_column)

    # ------------------------------------------------------------ per row

    def _text(self, row: Row, task: RowTask) -> tuple[str | None, bool]:
        """(text, add_special_tokens), or sets task.error. Token ids given directly go to task.prompt_ids."""
        if self.openai:
            if "messages" in row:
                return self._render(row["messages"], task), False
            prompt = row.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in prompt):
                task.prompt_ids = list(prompt)
                return None, True
            return self._plain(prompt, task, "prompt"), True
        if self.messages_column:
            if self.messages_column not in row:
                task.error = f"column {self.messages_column!r} is missing in this row"
                return None, False
            return self._render(row[self.messages_column], task), False
        if self.prompt_column not in row:
            task.error = f"column {self.prompt_column!r} is missing in this row"
            return None, True
        return self._plain(row[self.prompt_column], task, self.prompt_column), True

    @staticmethod
    def _plain(value: Any, task: RowTask, name: str) -> str | None:
        if isinstance(value, str):
            task.prompt = value  # kept for include_prompt, even when the row is an error
        if value is None:
            task.error = f"{name} is null"
        elif not isinstance(value, str):
            task.error = f"{name} is not a string ({type(value).__name__})"
        elif not value.strip():
            task.error = f"{name} is empty"
        else:
            return value
        return None

    def _render(self, messages: Any, task: RowTask) -> str | None:
        why = _check_messages(messages)
        if why:
            task.error = f"malformed messages: {why}"
            return None
        if not self.has_template:
            task.error = "the tokenizer has no chat template for messages"
            return None
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template can raise anything (jinja errors, raise_exception)
            task.error = f"chat template failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            return None
        if not isinstance(text, str) or not text:
            task.error = "chat template rendered nothing"
            return None
        return text

    def _params(self, row: Row, task: RowTask) -> SamplingParams | None:
        values = dict(self.base)
        given = set()
        for name, column in self.inp["sampling_columns"].items():
            value = row.get(column)
            if value is None:
                continue
            if name in STRUCTURED_KINDS:  # a row's schema / regex / choices / grammar replaces the job's
                job_level = self.base.get("structured_outputs") or {}
                values["structured_outputs"] = {name: value, **{k: v for k, v in job_level.items()
                                                                if k == "disable_any_whitespace"}}
                given.add("structured_outputs")
            else:
                values[name] = _coerce(name, value)
                given.add(name)
        if self.openai:
            for name, value in (row.get("sampling") or {}).items():
                values[name] = _coerce(name, value)
                given.add(name)
        if "seed" not in given and self.base_seed is not None:
            values["seed"] = self.base_seed + task.index  # each row its own stream; the same on every rerun
        for name in given:  # the job's own values were checked with the job file
            why = check_sampling_value(name, values[name])
            if why:
                task.error = f"sampling {name}: {why}"
                return None
        try:
            params = SamplingParams(**values)
        except (ValueError, TypeError) as e:
            name, msg = sampling_error(e) if isinstance(e, ValueError) else (None, str(e))
            task.error = f"sampling {name}: {msg}" if name else f"sampling: {msg}"
            return None
        if params.structured_outputs is not None and self.check_structured is not None:
            why = self.check_structured(params)  # compiled once per distinct spec, under a time limit
            if why:
                task.error = f"structured_outputs: {why}"
                return None
        return params

    # ------------------------------------------------------------ batches

    def build(self, items: list[tuple[int, int, Row]]) -> list[RowTask]:
        """items: (pos, global index, row). Returns one RowTask per item, in order."""
        if self.task == "loglikelihood":
            return self._build_scored(items)
        if self.task in POOLED_TASKS:
            return build_pooled(self, items)
        tasks: list[RowTask] = []
        to_tokenize: dict[bool, list[tuple[RowTask, str]]] = {True: [], False: []}
        for pos, index, row in items:
            task = RowTask(pos=pos, index=index, id=index)
            tasks.append(task)
            if ROW_ERROR in row:
                task.error = row[ROW_ERROR]
                if self.openai and row.get("custom_id") is not None:
                    task.extra = {"custom_id": row["custom_id"], "url": None, "model": None}
                    task.id = row["custom_id"]
                continue
            if self.openai:
                task.extra = {"custom_id": row.get("custom_id"), "url": row.get("url"), "model": row.get("model"),
                              "echo": bool(row.get("echo"))}
                task.id = row.get("custom_id") if row.get("custom_id") is not None else index
                if "pooling_body" in row:
                    self._openai_pooled(task, row)
                    continue
                if self.pooling is not None and not self.pooling.generates:
                    task.error = f"this model pools only: it runs {', '.join(self.pooling.tasks())}, not {row['url']}"
                    continue
            elif self.id_column:
                task.id = row.get(self.id_column)
            task.keep = {c: row.get(c) for c in self.inp["keep_columns"]}
            text, special = self._text(row, task)
            if task.error:
                continue
            task.prompt = text
            task.params = self._params(row, task)
            if task.error:
                continue
            if text is not None:
                to_tokenize[special].append((task, text))
        for special, pairs in to_tokenize.items():
            if not pairs:
                continue
            encoded = self.tokenizer([t for _, t in pairs], add_special_tokens=special)["input_ids"]
            for (task, _), ids in zip(pairs, encoded):
                task.prompt_ids = list(ids)
        for task in tasks:
            if task.error is None and task.prompt_ids is not None and task.pooling is None:
                task.prompt_tokens = len(task.prompt_ids)
                why = self.check_prompt(task.prompt_ids, scores_prompt(task.params))
                if why and self._too_long(task.prompt_ids):
                    why = self._fit(task, why)
                if why:
                    task.error = why
            if not task.runs:
                task.prompt_ids = None
                task.params = None
        return tasks

    def _openai_pooled(self, task: RowTask, row: Row) -> None:
        """A pooling endpoint's request: its prompts, each of which must fit max_model_len whole."""
        pooled_request(task, row["url"], row["pooling_body"], self.tokenizer,
                       self.pooling is not None and self.pooling.scores_by_head())
        for ids in ([task.prompt_ids, *task.more_ids] if task.error is None else []):
            why = self.check_prompt(ids, True)
            if why:
                task.error = why
                break
        if task.error is not None:
            task.prompt_ids = task.more_ids = task.pooling = None

    def row_task(self, pos: int, index: int, row: Row) -> RowTask:
        """A column row's task (not an OpenAI batch line's): its id and kept columns, or the read error it carries."""
        task = RowTask(pos=pos, index=index, id=index)
        if ROW_ERROR in row:
            task.error = row[ROW_ERROR]
            return task
        if self.id_column:
            task.id = row.get(self.id_column)
        task.keep = {c: row.get(c) for c in self.inp["keep_columns"]}
        return task

    def _too_long(self, ids: list[int], scored: bool = False) -> bool:
        return (self.on_too_long != "error" and self.max_model_len is not None
                and len(ids) > self.max_model_len - (0 if scored else 1))

    def _fit(self, task: RowTask, why: str) -> str | None:
        """input.on_too_long: cut the prompt so that it and max_tokens fit (truncate_left keeps a leading BOS), or
        skip the row. Returns the row error that remains, if any."""
        if self.on_too_long == "skip":
            task.skipped = f"{why} (input.on_too_long: skip)"
            return None
        ids, limit = task.prompt_ids, self.max_model_len
        room = min(1 if task.params.max_tokens is None else task.params.max_tokens, limit - 1)  # keep a prompt token
        keep = limit - room
        if self.on_too_long == "truncate_right":
            cut = ids[:keep]
        else:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            head = ids[:1] if bos is not None and ids[0] == bos and keep > 1 else []
            cut = head + ids[len(ids) - (keep - len(head)):]
        task.truncated = len(ids) - len(cut)
        task.prompt_ids, task.prompt_tokens = cut, len(cut)
        return self.check_prompt(cut, scores_prompt(task.params))

    # ------------------------------------------------------------ task: loglikelihood

    def _build_scored(self, items: list[tuple[int, int, Row]]) -> list[RowTask]:
        """(context, continuation) rows, as lm-eval's harness scores them: the context tokenized as a prompt (the
        tokenizer's special tokens), the continuation without special tokens, the request their concatenation, run
        for its prompt's log-probabilities alone (nothing generated)."""
        contexts, continuations = self.inp["context_column"], self.inp["continuation_column"]
        tasks: list[RowTask] = []
        pairs: list[tuple[RowTask, str, str]] = []
        for pos, index, row in items:
            task = self.row_task(pos, index, row)
            tasks.append(task)
            if task.error is not None:
                continue
            context, continuation = row.get(contexts), row.get(continuations)
            task.error = text_problem(row, contexts, empty_ok=True) or text_problem(row, continuations)
            if task.error is None:
                task.prompt = context + continuation
                task.params = SamplingParams(max_tokens=0, prompt_logprobs=0, detokenize=False)
                pairs.append((task, context, continuation))
        if pairs:
            ctx_ids = self.tokenizer([c for _, c, _ in pairs], add_special_tokens=True)["input_ids"]
            cont_ids = self.tokenizer([c for _, _, c in pairs], add_special_tokens=False)["input_ids"]
            for (task, _, _), ctx, cont in zip(pairs, ctx_ids, cont_ids):
                task.error = self._scored_request(task, list(ctx), list(cont))
        for task in tasks:
            if not task.runs:
                task.prompt_ids = None
                task.params = None
        return tasks

    def _scored_request(self, task: RowTask, ctx: list[int], cont: list[int]) -> str | None:
        """Sets the row's prompt (context then continuation); returns its row error, if any. An empty context is
        the tokenizer's BOS token (else its EOS token), as the harness does: the first continuation token needs one
        before it."""
        if not cont:
            return "the continuation has no tokens"
        if not ctx:
            prefix = next((t for t in (getattr(self.tokenizer, "bos_token_id", None),
                                       getattr(self.tokenizer, "eos_token_id", None)) if t is not None), None)
            if prefix is None:
                return "the context is empty and the tokenizer has no BOS or EOS token to stand for it"
            ctx = [prefix]
        ids = ctx + cont
        task.prompt_ids, task.prompt_tokens, task.continuation_tokens = ids, len(ids), len(cont)
        why = self.check_prompt(ids, True)
        if why and self._too_long(ids, scored=True):
            return self._fit_context(task, why)
        if why and self.max_model_len is not None and len(ids) > self.max_model_len:
            return (f"context and continuation have {len(ids)} tokens; max_model_len={self.max_model_len} scores at "
                    f"most {self.max_model_len}")
        return why

    def _fit_context(self, task: RowTask, why: str) -> str | None:
        """input.on_too_long for a scored row: skip it, or cut its context from the left (keeping a leading BOS) so
        that context and continuation fit; the continuation is never cut (truncate_right is refused for the task)."""
        if self.on_too_long == "skip":
            task.skipped = f"{why} (input.on_too_long: skip)"
            return None
        ids, n = task.prompt_ids, task.continuation_tokens
        ctx, limit = ids[:-n], self.max_model_len  # a scored prompt may fill max_model_len
        room = limit - n
        if room < 1:
            return (f"the continuation alone has {n} tokens, leaving no room for a context within "
                    f"max_model_len={self.max_model_len}")
        bos = getattr(self.tokenizer, "bos_token_id", None)
        head = ctx[:1] if bos is not None and ctx[0] == bos and room > 1 else []
        cut = head + ctx[len(ctx) - (room - len(head)):]
        task.truncated = len(ctx) - len(cut)
        task.prompt_ids = cut + ids[-n:]
        task.prompt_tokens = len(task.prompt_ids)
        return self.check_prompt(task.prompt_ids, True)


def input_columns(cfg: JobConfig, source_format: str, id_column: str | None) -> list[str] | None:
    """The input columns a job reads (None: all, for openai-batch, whose rows are normalized requests).
    Needs no tokenizer, so a driver that loads no model (the Ray executor) can select columns too."""
    if source_format == "openai-batch":
        return None
    inp = cfg.input
    if cfg.task == "loglikelihood":
        cols = [inp["context_column"], inp["continuation_column"]]
    elif cfg.task == "score":
        cols = [inp["text_1_column"], inp["text_2_column"]]
    else:
        cols = [inp["messages_column"] or inp["prompt_column"]]
    if id_column:
        cols.append(id_column)
    cols += list(inp["keep_columns"]) + (list(inp["sampling_columns"].values()) if cfg.task == "generate" else [])
    return list(dict.fromkeys(cols))


def _coerce(name: str, value: Any) -> Any:
    """Integral floats (as JSON / pandas often store counts) become ints for integer fields."""
    if name in _INT_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list):
        return f"expected a list of {{role, content}}, got {type(messages).__name__}"
    if not messages:
        return "the list is empty"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is not a mapping ({type(m).__name__})"
        if not isinstance(m.get("role"), str) or not m.get("role"):
            return f"message {i} has no role"
        content = m.get("content")
        if not isinstance(content, str):
            return f"message {i} content is not a string ({type(content).__name__})"
    return None
