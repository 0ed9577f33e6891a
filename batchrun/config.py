"""The job file: YAML in, a validated JobConfig out, before anything heavy is imported or loaded.

Every key is declared once: the `model:` and `engine:` sections are EngineArgs' fields (their defaults and
rules live in batchrun.engine_args), the `sampling:` section is SamplingParams' own fields, checked by
SamplingParams itself, the other sections are declared in SCHEMA, and the keys beside the sections (`task`) in
TOP_KEYS. A mistake raises JobError with one line naming the key path, e.g.
``job.yaml: sampling.max_tokens: must be an integer >= 1, got -5``."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from batchrun.engine_args import (
    EngineArgs,
    EngineArgsError,
    Rule,
    field_of,
    job_key,
    job_rules,
    parse_size,
    show,
)
from batchrun.pooling_params import POOLING_TYPES, PoolingParams
from batchrun.sampling_params import STRUCTURED_KINDS, SamplingParams


class JobError(Exception):
    """A bad job file, a bad --set or an unreadable input: exit code 2, reported in one line."""


@dataclass(frozen=True)
class Key(Rule):
    """A job-file key: an EngineArgs Rule, plus the kinds only the input section has."""

    def kind_problem(self, value: Any) -> str | None:
        kind = self.kind
        if kind == "str_list":
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                return f"expected a list of column names, got {show(value)}"
            if len(set(value)) != len(value):
                return "lists a column twice"
        elif kind == "str_map":
            if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
                return f"expected a mapping of name: column, got {show(value)}"
        elif kind == "data_files":
            ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)) or (
                isinstance(value, dict) and all(isinstance(v, (str, list)) for v in value.values()))
            if not ok:
                return f"expected a path, a list of paths or a split: paths mapping, got {show(value)}"
        return super().kind_problem(value)


TASKS = ("generate", "loglikelihood", "embed", "classify", "score")  # what a job does with each row
POOLED_TASKS = ("embed", "classify", "score")  # the tasks that pool a prompt (`pooling:`), generating nothing

# Keys beside the sections, at the top of the job file.
TOP_KEYS: dict[str, Rule] = {
    "task": Key("generate", "str", TASKS, doc=(
        "What each row is. generate: a prompt (or messages), completed under `sampling:`. loglikelihood: a context "
        "and a continuation (`input.context_column`, `input.continuation_column`), scored: the continuation's "
        "summed log-probability after the context, whether greedy decoding gives it, its token count (Scoring "
        "continuations, below); `sampling:` does not apply. embed: a prompt's embedding (`embedding`). classify: a "
        "classifier's `logits`, `probs` and `label`. score: a pair of texts (`input.text_1_column`, "
        "`input.text_2_column`) scored by a cross-encoder, or by the cosine of their embeddings (Pooling, below).")),
}

SCHEMA: dict[str, dict[str, Rule]] = {
    "model": job_rules("model"),  # path, dtype, device, max_model_len
    "input": {
        "path": Key(kind="str", required=True, doc=(
            "The input: a Parquet file, folder or glob; a JSONL file, folder or glob; a saved Hugging Face dataset "
            "folder or a `load_dataset` name; or an OpenAI batch input file.")),
        "format": Key(None, "str", ("parquet", "jsonl", "dataset", "openai-batch"), nullable=True, doc=(
            "null: inferred from the path (see Inputs below).")),
        "prompt_column": Key("prompt", "str", doc="The column of prompt text."),
        "messages_column": Key(None, "str", nullable=True, doc=(
            "Instead of `prompt_column`: a column of chat messages, `[{role, content}, ...]`, rendered with the "
            "tokenizer's chat template.")),
        "context_column": Key("context", "str", doc=(
            "`task: loglikelihood`: the column of contexts, tokenized as a prompt (with the tokenizer's special "
            "tokens).")),
        "continuation_column": Key("continuation", "str", doc=(
            "`task: loglikelihood`: the column of continuations, tokenized without special tokens and scored "
            "after their context.")),
        "text_1_column": Key("text_1", "str", doc="`task: score`: the column of first texts (a query)."),
        "text_2_column": Key("text_2", "str", doc="`task: score`: the column of second texts (a document)."),
        "id_column": Key("id", "str", nullable=True, doc=(
            "The column the output's `id` is copied from; null, or the default `id` absent from the input: the "
            "row numbers.")),
        "keep_columns": Key([], "str_list", doc="Input columns copied to the output unchanged."),
        "split": Key("train", "str", doc="The split of a dataset input."),
        "data_files": Key(None, "data_files", nullable=True, doc=(
            "With `format: dataset` and a builder name (json, parquet, csv, ...) as `path`: its files (a path, a "
            "list, or a `split: paths` mapping).")),
        "sampling_columns": Key({}, "str_map", doc=(
            "Per-row sampling values from columns, `{SamplingParams field: column}`, e.g. `{max_tokens: budget}`; "
            "also `json`, `regex`, `choice`, `grammar` or `structured_outputs` for a row's structured output. A "
            "null cell keeps the `sampling:` value.")),
        "on_error": Key("record", "str", ("record", "skip", "fail"), doc=(
            "A row that cannot run: record (an output row with `finish_reason: error` and `error` saying why), "
            "skip (no output row), fail (exit 1 after committing every row before it).")),
        "on_too_long": Key("error", "str", ("error", "truncate_left", "truncate_right", "skip"), doc=(
            "A prompt longer than the model takes: error (a row error), truncate_left (keep its end) or "
            "truncate_right (keep its start) so that it and `max_tokens` fit, skip (written with "
            "`finish_reason: skipped`); docs/durability.md. `task: loglikelihood`: truncate_left cuts the context "
            "from the left, never the continuation.")),
    },
    "engine": job_rules("engine"),  # block_size, kv_cache_memory, ... (EngineArgs)
    "pooling": {  # task: embed, classify, score
        "pooling_type": Key(None, "str", POOLING_TYPES, nullable=True, doc=(
            "last (the last token's hidden state), mean (of all tokens') or cls (the first token's); null: the "
            "checkpoint's (sentence-transformers' Pooling module, else last for decoders, cls for encoders).")),
        "normalize": Key(None, "bool", nullable=True, doc=(
            "embed: L2-normalise each embedding; null: the checkpoint's (sentence-transformers' Normalize module; "
            "without those files, yes).")),
        "dimensions": Key(None, "int", nullable=True, min=1, doc=(
            "embed: keep each embedding's first N values (Matryoshka models), then normalise.")),
        "embedding_dtype": Key("float32", "str", ("float32", "float16"), doc=(
            "embed: the `embedding` column's values.")),
        "prefix": Key(None, "str", nullable=True, doc=(
            "Text put before each prompt (an embedding model's instruction, e.g. `query: `); a sentence-transformers "
            "prompt name of the checkpoint (`prompt_name:query`) takes that prompt.")),
    },
    "output": {
        "path": Key(kind="str", required=True, doc=(
            "The output folder (created); with `--shard I/N`, `OUTPUT/shard-I-of-N/`.")),
        "rows_per_part": Key(10000, "int", min=1, doc="Output rows per Parquet part."),
        "include_prompt": Key(False, "bool", doc=(
            "Add the prompt as a `prompt` column (for chat messages: the rendered template, system prompt and "
            "all).")),
        "include_token_ids": Key(False, "bool", doc="Add the completion's token ids as `token_ids`."),
        "commit_interval_s": Key(60, "number", min=0.1, doc=(
            "Also commit a part after this many seconds, so that a SIGKILL loses at most this much work.")),
    },
    "executor": {
        "kind": Key("local", "str", ("local", "ray"), doc=(
            "local: this process; ray: engines on a Ray cluster (docs/cluster.md). The keys below are for ray.")),
        # kind: ray only (batchrun.distributed)
        "replicas": Key(1, "int", min=1, doc="Engines, one per Ray actor."),
        "address": Key(None, "str", nullable=True, doc=(
            "null: start a Ray on this machine; `auto`: join this node's cluster; `ray://head:10001`: a remote "
            "one.")),
        "num_gpus_per_replica": Key(0, "number", min=0, doc="GPUs per replica (1 on a GPU cluster)."),
        "num_cpus_per_replica": Key(1, "number", min=0.01, doc="CPUs per replica."),
        "batch_size": Key(256, "int", min=1, doc="Rows per Ray Data batch sent to a replica."),
    },
}

# The job runner's sampling defaults differ from SamplingParams' in two places: a batch job is greedy and
# reproducible unless asked otherwise, and 16 tokens is rarely what a batch job wants.
SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0, "seed": 0}

_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class JobConfig:
    model: dict[str, Any]
    input: dict[str, Any]
    sampling: dict[str, Any]
    engine: dict[str, Any]
    output: dict[str, Any]
    executor: dict[str, Any]
    task: str = "generate"  # TOP_KEYS["task"]: what each row is
    pooling: dict[str, Any] = field(default_factory=dict)  # SCHEMA["pooling"]
    source: str = "<job>"  # where it was read from, for messages
    explicit: set[str] = field(default_factory=set)  # key paths the job file (or --set) gave

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{**self.sampling, **overrides})

    def pooling_params(self) -> PoolingParams:
        p = self.pooling
        return PoolingParams(dimensions=p["dimensions"], use_activation=p["normalize"], pooling_type=p["pooling_type"])

    def engine_args(self) -> EngineArgs:
        """The model and engine sections as the EngineArgs LLM takes; the engine's base seed is sampling.seed, and a
        pooled task's engine only pools."""
        args = _engine_args(self.model, self.engine, self.sampling.get("seed"))
        return dataclasses.replace(args, runner="pooling") if self.task in POOLED_TASKS else args

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for LLM(model, **kwargs)."""
        return self.engine_args().llm_kwargs()


def _engine_args(model: dict[str, Any], engine: dict[str, Any], seed: int | None) -> EngineArgs:
    values = {field_of(f"{section}.{k}"): v for section, keys in (("model", model), ("engine", engine))
              for k, v in keys.items()}
    return EngineArgs(**values, seed=0 if seed is None else seed)


ENGINE_SECTIONS = ("model", "engine")


@dataclass
class EngineSettings:
    """A job file's `model:` and `engine:` sections alone, checked and with their defaults filled in: what
    `batchrun serve` takes (--model, --config, --set), and gives the job of every batch it runs."""

    model: dict[str, Any]
    engine: dict[str, Any]

    def engine_args(self) -> EngineArgs:
        return _engine_args(self.model, self.engine, None)


# ---------------------------------------------------------------- loading


def load_job(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a job file, apply `--set key.path=value` overrides, expand ${VAR}, validate."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise JobError(f"{name}: cannot read the job file: {e.strerror or e}") from None
    return parse_job(text, source=name, overrides=overrides)


def parse_job(text: str, *, source: str = "<job>", overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    raw = _parse_yaml(text, source)
    for item in overrides:
        apply_set(raw, item)
    raw = _expand_env(raw, "", source)
    return validate_raw(raw, source=source)


def _parse_yaml(text: str, source: str) -> dict:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise JobError(f"{source}: invalid YAML{where}: {problem}") from None
    if raw is None:
        raise JobError(f"{source}: the job file is empty")
    if not isinstance(raw, dict):
        raise JobError(f"{source}: the job file must be a mapping of sections "
                       f"({', '.join(SCHEMA)} and sampling) and keys ({', '.join(TOP_KEYS)}), got {type(raw).__name__}")
    return copy.deepcopy(raw)


def load_engine_settings(model: str | None, config: str | os.PathLike | None = None,
                         overrides: list[str] | tuple[str, ...] = ()) -> EngineSettings:
    """The settings of `batchrun serve`: a job file's `model:` and `engine:` sections (`config`; its other
    sections are not read), then `--set model.X=...` / `--set engine.X=...`, then `model` (--model) as
    model.path. Checked by a job file's rules; JobError names the key."""
    source = str(config) if config is not None else "batchrun serve"
    raw: dict[str, Any] = {}
    if config is not None:
        try:
            with open(config, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise JobError(f"{source}: cannot read the job file: {e.strerror or e}") from None
        raw = {k: v for k, v in _parse_yaml(text, source).items() if k in ENGINE_SECTIONS}
    for item in overrides:
        if item.partition("=")[0].strip().split(".")[0] not in ENGINE_SECTIONS:
            raise JobError(f"--set {item}: batchrun serve takes model.* and engine.* settings only (each "
                           "request of a batch carries its own sampling values)")
        apply_set(raw, item)
    if model is not None:
        if not isinstance(raw.get("model"), dict):
            raw["model"] = {}
        raw["model"]["path"] = model
    if not isinstance(raw.get("model"), dict) or raw["model"].get("path") is None:
        raise JobError("--model: required (or model.path in the --config job file)")
    raw = _expand_env(raw, "", source)
    explicit: set[str] = set()
    sections = {name: _validate_section(name, raw.get(name), source, explicit) for name in ENGINE_SECTIONS}
    settings = EngineSettings(model=sections["model"], engine=sections["engine"])
    try:
        settings.engine_args()
    except EngineArgsError as e:
        raise JobError(f"{source}: {job_key(e.field) or e.field}: {e.problem}") from None
    return settings


def apply_set(raw: dict, item: str) -> None:
    """Apply one `key.path=value` (value parsed as YAML); the key must exist in the schema."""
    if "=" not in item:
        raise JobError(f"--set {item}: expected key.path=value")
    path, _, text = item.partition("=")
    path = path.strip()
    parts = path.split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise JobError(f"--set {item}: the value is not valid YAML: {getattr(e, 'problem', e)}") from None
    section = parts[0]
    if section in TOP_KEYS:
        if len(parts) > 1:
            raise JobError(f"--set {item}: {section} has no sub-keys")
        raw[section] = value
        return
    known = list(SCHEMA) + ["sampling"] + list(TOP_KEYS)
    if section not in known:
        raise JobError(f"--set {item}: unknown section {section!r}{_suggest(section, known)}")
    keys = _section_keys(section)
    if len(parts) == 1:
        raise JobError(f"--set {item}: name a key inside {section}, e.g. {section}.{keys[0]}=...")
    if parts[1] not in keys:
        raise JobError(f"--set {item}: unknown key {section}.{parts[1]}{_suggest(parts[1], keys)}")
    depth_ok = 3 if (section, parts[1]) == ("input", "sampling_columns") else 2
    if len(parts) > depth_ok:
        raise JobError(f"--set {item}: {'.'.join(parts[:depth_ok])} has no sub-keys")
    node = raw
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {} if node.get(p) is None else node[p]
            if not isinstance(node[p], dict):
                raise JobError(f"--set {item}: {p} is not a mapping in the job file")
        node = node[p]
    node[parts[-1]] = value


def _section_keys(section: str) -> list[str]:
    if section == "sampling":
        return SamplingParams.field_names()
    return list(SCHEMA[section])


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(options)})"


def _expand_env(node: Any, path: str, source: str) -> Any:
    if isinstance(node, dict):
        return {k: _expand_env(v, f"{path}.{k}" if path else str(k), source) for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v, f"{path}[{i}]", source) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        def sub(m: re.Match) -> str:
            var, default = m.group(1), m.group(2)
            if var in os.environ:
                return os.environ[var]
            if default is not None:
                return default
            raise JobError(f"{source}: {path}: environment variable {var} is not set "
                           f"(use ${{{var}:-default}} for a default)")
        return _ENV_RE.sub(sub, node)
    return node


# ---------------------------------------------------------------- validation


def validate_raw(raw: dict, *, source: str = "<job>") -> JobConfig:
    sections: dict[str, dict] = {}
    explicit: set[str] = set()
    known = [*TOP_KEYS, *SCHEMA, "sampling"]
    for name in raw:
        if name not in known:
            raise JobError(f"{source}: {name}: unknown section{_suggest(str(name), known)}")
    top = {}
    for name, rule in TOP_KEYS.items():
        if name in raw:
            explicit.add(name)
            top[name] = _check(f"{source}: {name}", raw[name], rule)
        else:
            top[name] = copy.deepcopy(rule.default)
    for name in SCHEMA:
        sections[name] = _validate_section(name, raw.get(name), source, explicit)
    sampling = _validate_sampling(raw.get("sampling"), source, explicit)
    cfg = JobConfig(model=sections["model"], input=sections["input"], sampling=sampling,
                    engine=sections["engine"], output=sections["output"], executor=sections["executor"],
                    task=top["task"], pooling=sections["pooling"], source=source, explicit=explicit)
    try:  # each key passed its rule above; this is the one path LLM takes too
        cfg.engine_args()
    except EngineArgsError as e:
        raise JobError(f"{source}: {job_key(e.field) or e.field}: {e.problem}") from None
    _cross_checks(cfg)
    return cfg


def _validate_section(name: str, given: Any, source: str, explicit: set[str]) -> dict[str, Any]:
    """One section of SCHEMA: every key known and within its rule, the defaults filled in."""
    keys = SCHEMA[name]
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise JobError(f"{source}: {name}: expected a mapping of keys, got {show(given)}")
    for k in given:
        if k not in keys:
            raise JobError(f"{source}: {name}.{k}: unknown key{_suggest(str(k), list(keys))}")
    out = {}
    for k, spec in keys.items():
        if k in given:
            explicit.add(f"{name}.{k}")
            out[k] = _check(f"{source}: {name}.{k}", given[k], spec)
        elif spec.required:
            raise JobError(f"{source}: {name}.{k}: required key is missing")
        else:
            out[k] = copy.deepcopy(spec.default)
    return out


def _check(where: str, value: Any, spec: Rule) -> Any:
    why = spec.problem(value)
    if why:
        raise JobError(f"{where}: {why}")
    return value


@functools.cache
def _sampling_types() -> dict[str, Any]:
    hints = typing.get_type_hints(SamplingParams)
    return {name: hints[name] for name in SamplingParams.field_names()}


def check_type(value: Any, tp: Any) -> bool:
    """Does a YAML value fit a SamplingParams annotation (int, float, str | list[str] | None, ...)?"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(check_type(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(check_type(v, item) for v in value)
    return True


def describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(t) for t in typing.get_args(tp))
    names = {type(None): "null", bool: "true/false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    if origin is list:
        return f"a list of {describe_type(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    return str(tp)


def check_sampling_value(name: str, value: Any) -> str | None:
    """None if `value` has the right type for SamplingParams.`name`, else why not."""
    tp = _sampling_types()[name]
    if check_type(value, tp):
        return None
    return f"expected {describe_type(tp)}, got {show(value)}"


def sampling_error(err: ValueError) -> tuple[str | None, str]:
    """Split SamplingParams' "SamplingParams.top_p must be ..." into (field, message)."""
    m = re.match(r"SamplingParams\.(\w+) (.*)", str(err))
    if m:
        return m.group(1), m.group(2)
    return None, str(err)


def _validate_sampling(given: Any, source: str, explicit: set[str]) -> dict[str, Any]:
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise JobError(f"{source}: sampling: expected a mapping of SamplingParams fields, got {show(given)}")
    names = SamplingParams.field_names()
    for k, v in given.items():
        if k not in names:
            raise JobError(f"{source}: sampling.{k}: unknown key{_suggest(str(k), names)}")
        why = check_sampling_value(k, v)
        if why:
            raise JobError(f"{source}: sampling.{k}: {why}")
        explicit.add(f"sampling.{k}")
    values = {**SAMPLING_DEFAULTS, **given}
    if values.get("structured_outputs") is not None:
        values["structured_outputs"] = _structured_section(values["structured_outputs"], source)
    try:
        SamplingParams(**values)
    except ValueError as e:
        name, msg = sampling_error(e)
        raise JobError(f"{source}: sampling{'.' + name if name else ''}: {msg}") from None
    return values


def _structured_section(value: Any, source: str) -> dict[str, Any]:
    """sampling.structured_outputs: a mapping of StructuredOutputsParams fields, where `json_file: path`
    (relative to the working directory) stands for `json:` with that file's schema. The schema itself is
    kept, so a changed file is a changed job (resume refuses it)."""
    where = f"{source}: sampling.structured_outputs"
    if not isinstance(value, dict):
        raise JobError(f"{where}: expected a mapping such as {{json: <schema>}}, {{regex: ...}}, {{choice: [...]}} "
                       f"or {{grammar: ...}}, got {show(value)}")
    value = dict(value)
    if "json_file" in value:
        path = value.pop("json_file")
        if "json" in value:
            raise JobError(f"{where}: set json or json_file, not both")
        if not isinstance(path, str) or not path:
            raise JobError(f"{where}.json_file: expected a path, got {show(path)}")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise JobError(f"{where}.json_file: cannot read {path}: {e.strerror or e}") from None
        try:
            value["json"] = json.loads(text)
        except ValueError as e:
            raise JobError(f"{where}.json_file: {path} is not JSON: {e}") from None
    return value


# The output columns of each task, beside the id, the kept input columns and `prompt` (output.include_prompt).
TASK_COLUMNS = {
    "generate": ("completion", "finish_reason", "prompt_tokens", "completion_tokens", "error", "sample_index",
                 "token_ids", "logprobs", "prompt_logprobs"),
    "loglikelihood": ("logprob", "is_greedy", "num_tokens", "prompt_tokens", "token_ids", "error"),
    "embed": ("embedding", "prompt_tokens", "error"),
    "classify": ("logits", "probs", "label", "prompt_tokens", "error"),
    "score": ("score", "prompt_tokens", "error"),
}
# input keys that only some tasks read
_TASK_INPUT_KEYS = {"context_column": ("loglikelihood",), "continuation_column": ("loglikelihood",),
                    "text_1_column": ("score",), "text_2_column": ("score",),
                    "prompt_column": ("generate", "embed", "classify"), "messages_column": ("generate", "embed",
                                                                                             "classify"),
                    "sampling_columns": ("generate",)}


def _cross_checks(cfg: JobConfig) -> None:
    src, inp = cfg.source, cfg.input
    # a key of the other task is refused once it differs from its default (a job file naming every key passes)
    for key, tasks in _TASK_INPUT_KEYS.items():
        if cfg.task not in tasks and inp[key] != SCHEMA["input"][key].default:
            raise JobError(f"{src}: input.{key}: used with task: {' / '.join(tasks)} only (this job's task is "
                           f"{cfg.task})")
    if cfg.task != "generate":
        own = {f.name: f.default for f in fields(SamplingParams)}
        given = sorted(k for k, v in cfg.sampling.items() if v != SAMPLING_DEFAULTS.get(k, own.get(k)))
        if given:
            raise JobError(f"{src}: sampling.{given[0]}: not used with task: {cfg.task} (each row's prompt is "
                           f"{'scored' if cfg.task == 'loglikelihood' else 'pooled'}, nothing is sampled)")
    if cfg.task not in POOLED_TASKS:
        given = sorted(k for k, v in cfg.pooling.items() if v != SCHEMA["pooling"][k].default)
        if given:
            raise JobError(f"{src}: pooling.{given[0]}: used with task: embed / classify / score only (this job's "
                           f"task is {cfg.task})")
    if cfg.task == "loglikelihood" and inp["on_too_long"] == "truncate_right":
        raise JobError(f"{src}: input.on_too_long: truncate_right would cut the continuation; with task: "
                       "loglikelihood use truncate_left (cuts the context from the left), skip or error")
    if "input.prompt_column" in cfg.explicit and inp["messages_column"]:
        raise JobError(f"{src}: input.messages_column: set either prompt_column or messages_column, not both")
    names = SamplingParams.field_names() + list(STRUCTURED_KINDS)
    for k in inp["sampling_columns"]:
        if k not in names:
            raise JobError(f"{src}: input.sampling_columns.{k}: not a SamplingParams field{_suggest(str(k), names)}")
    reserved = {"id", *TASK_COLUMNS[cfg.task]}
    if cfg.output["include_prompt"]:
        reserved.add("prompt")
    for col in inp["keep_columns"]:
        if col in reserved and col != inp["id_column"]:
            raise JobError(f"{src}: input.keep_columns: {col!r} clashes with an output column of that name")


def size_to_bytes(value: int | str | None) -> int | None:
    """'4GiB' -> 4294967296 (K/M/G/T are powers of 1000, Ki/Mi/Gi/Ti of 1024)."""
    return parse_size(value)
