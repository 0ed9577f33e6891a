"""plan_job(): everything about a job that can be checked without the model, and how its rows are sliced.

Checks the model and engine settings against this machine and where the model path points (the same checks
LLM makes, batchrun.model.weights.locate), opens the input (readable, the columns exist), picks this shard's slice of
rows, checks the output folder is writable and whether it holds committed rows of this same job (resume) or of
another one (refused, exit 2). Nothing is loaded, nothing is written."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.config import POOLED_TASKS, EngineSettings, JobConfig, JobError
from batchrun.engine.pooling import prompt_only_kv_tokens
from batchrun.engine_args import EngineArgs, EngineArgsError, field_of, job_key
from batchrun.io.slicing import RowSlice
from batchrun.io.sources import Source, open_source
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights.locate import ModelSource, check_args
from batchrun.output.folder import check_output_dir
from batchrun.output.sink import OutputSpec
from batchrun.output.state import OutputStatus, OutputTarget, read_status
from batchrun.sampling_params import SamplingParams
from batchrun.shards import ShardSpec

__all__ = ["ShardSpec", "JobPlan", "plan_job", "describe_plan"]

FINGERPRINT_VERSION = 1
# Job keys beyond the fingerprint's model, input, sampling and output that change what the model computes (other
# weights, another KV cache format): a job's fingerprint holds them only where they differ from EngineArgs'
# defaults, so an output written before they existed, or with their defaults, keeps its fingerprint (and resumes),
# and a rerun that changes one is refused like any other change of the job. The rest of the engine settings
# (batch sizes, threads, block size, backends) may change between runs.
NUMERICS_KEYS = ("model.quantization", "model.quantize_lm_head", "model.calibration", "engine.kv_cache_dtype")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- checks that need no model


RAY_INSTALL_HINT = "pip install 'batchrun[ray]'  (or: pip install 'ray[data]>=2.50')"


def check_ray() -> None:
    """JobError (exit 2) when Ray Data cannot be imported: `executor.kind: ray` is refused here, before any model
    loads, rather than by batchrun/distributed/ (a layer above this one), which never imports Ray at module level."""
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError as e:
        raise JobError(f"executor.kind: ray needs Ray Data, which is not installed here ({e}); "
                       f"install it with: {RAY_INSTALL_HINT}") from None


def check_model(cfg: JobConfig | EngineSettings) -> ModelSource:
    """The model and engine settings against this machine, and where the model path points: the same checks
    LLM makes before it loads anything, so that `validate`, `run` and `serve` accept exactly what LLM does."""
    try:
        return check_args(cfg.engine_args())
    except EngineArgsError as e:
        raise JobError(f"{job_key(e.field) or e.field}: {e.problem}") from None
    except ModelLoadError as e:
        raise JobError(f"model.path: {e}") from None


def check_task(cfg: JobConfig, model: ModelSource) -> None:
    """The model can do the job's task, from its config.json alone: a classifier or a bare encoder generates
    nothing, classify needs a classification head, score a one-label head (a cross-encoder) or none (cosine)."""
    if model.path is None or model.kind != "checkpoint":
        return  # a built-in or GGUF model: a decoder, which runs every task but classify
    from batchrun.model.arch.blocks import pooling_architecture
    from batchrun.model.arch.registry import model_class
    from batchrun.model.weights.loader import architecture, load_config

    try:
        config = load_config(model.path)
        arch = architecture(config)
        encoder = bool(getattr(model_class(arch), "is_encoder", False))
    except (ModelLoadError, KeyError, ValueError, OSError):
        return  # the load reports it
    head = arch.endswith("ForSequenceClassification")
    labels = getattr(config, "num_labels", 0) if head else 0
    pooling_only = encoder or pooling_architecture(config) is not None
    why = None
    if cfg.task in ("generate", "loglikelihood") and pooling_only:
        why = f"is {'a classifier' if head else 'an embedding model'} ({arch}): it runs task embed" + \
              (", classify" if head else "") + (" or score" if not head or labels == 1 else "")
    elif cfg.task == "classify" and not head:
        why = f"has no classification head ({arch}): task classify needs a *ForSequenceClassification checkpoint"
    elif cfg.task == "score" and head and labels != 1:
        why = f"is a classifier with {labels} labels ({arch}): task score needs a one-label cross-encoder or an " \
              "embedding model"
    if why:
        raise JobError(f"task: {cfg.task}: {model.spec} {why}")


def _labels(model: ModelSource) -> list[str]:
    """A classifier's label names by index (config.json's id2label); none where it has none."""
    try:
        id2label = json.loads((model.path / "config.json").read_text()).get("id2label") or {}
        return [str(id2label.get(str(i), i)) for i in range(len(id2label))]
    except (OSError, ValueError, TypeError, AttributeError):
        return []


def check_structured_outputs(cfg: JobConfig, model: ModelSource) -> None:
    """The job-level structured output compiles, with the model's tokenizer alone (no weights): a bad
    schema, regex or grammar, or one that overruns engine.grammar_compile_timeout_s, is exit 2 now."""
    spec = cfg.sampling.get("structured_outputs")
    if spec is None:
        return
    from batchrun.model.weights.loader import (
        eos_ids,
        load_config,
        load_tokenizer,
        resolve_path,
        tokenizer_path,
    )
    from batchrun.sampling_params import SamplingParams

    try:
        from batchrun.structured.compiler import StructuredOutputs
    except ImportError as e:
        raise JobError(f"sampling.structured_outputs: {e}") from None

    try:
        path, trust = resolve_path(model.load_spec), cfg.model["trust_remote_code"]
        config = load_config(path, trust)
        tokenizer = load_tokenizer(tokenizer_path(model.tokenizer) if model.tokenizer else path, trust)
    except (ModelLoadError, OSError, ValueError) as e:
        raise JobError(f"model.path: cannot read the tokenizer for sampling.structured_outputs: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    compiler = StructuredOutputs(tokenizer, config.vocab_size, eos_ids(path, config, tokenizer),
                                 timeout_s=cfg.engine["grammar_compile_timeout_s"])
    why = compiler.check(SamplingParams(structured_outputs=spec).structured_outputs)
    if why:
        raise JobError(f"sampling.structured_outputs: {why}")


# ---------------------------------------------------------------- plan


@dataclass
class JobPlan:
    cfg: JobConfig
    source: Source
    shard: ShardSpec | None
    limit: int | None
    output: OutputTarget
    id_column: str | None
    model: ModelSource | None = None  # where model.path points (checked, nothing loaded)
    lo: int = 0  # global index of this shard's first row (contiguous slices)
    hi: int | None = None  # one past its last row (None: to the end)
    strided: bool = False  # slice i % N == I instead (when the row count is unknown)
    resume: bool = True  # False: --no-resume (start afresh whatever is committed)
    retry_errors: bool = False  # --retry-errors: compute again the rows of a complete output with an error
    status: OutputStatus = field(default_factory=OutputStatus)  # what the output folder holds for this job
    total: int | None = None  # rows this shard covers (after --limit), when known
    kv_cache_tokens: int | None = None  # what the run's rows need of the KV pool (job_kv_tokens), None: unknown

    @property
    def out_dir(self) -> Path:
        return self.output.out_dir

    def row_slice(self, start: int = 0) -> RowSlice:
        """This shard's slice (contiguous or strided, --limit), resuming at position `start`."""
        if self.strided:
            return RowSlice(base=self.shard.index, stride=self.shard.count, start=start, limit=self.limit)
        length = None if self.hi is None else self.hi - self.lo
        return RowSlice(base=self.lo, start=start, length=length, limit=self.limit)


def _input_fingerprint(cfg: JobConfig, source: Source) -> dict[str, Any]:
    inp = cfg.input
    fp = {**source.identity(), "prompt_column": inp["prompt_column"], "messages_column": inp["messages_column"],
          "id_column": inp["id_column"], "keep_columns": inp["keep_columns"],
          "sampling_columns": inp["sampling_columns"], "on_error": inp["on_error"]}
    if cfg.task == "loglikelihood":  # the columns it reads instead (absent otherwise: earlier outputs resume)
        del fp["prompt_column"], fp["messages_column"], fp["sampling_columns"]
        fp.update(context_column=inp["context_column"], continuation_column=inp["continuation_column"])
    if cfg.task in POOLED_TASKS:  # what each row's answer is made of
        del fp["sampling_columns"]
        fp.update(task=cfg.task, pooling=cfg.pooling)
        if cfg.task == "score":
            del fp["prompt_column"], fp["messages_column"]
            fp.update(text_1_column=inp["text_1_column"], text_2_column=inp["text_2_column"])
    if inp["on_too_long"] != "error":  # absent at its default: outputs written before the key existed resume
        fp["on_too_long"] = inp["on_too_long"]
    return fp


def plan_job(cfg: JobConfig, *, shard: ShardSpec | None = None, limit: int | None = None,
             resume: bool = True, retry_errors: bool = False, source: Source | None = None) -> JobPlan:
    """Every check short of loading the model. Raises JobError (exit 2). source: the input, already open
    (batchrun serve reads a batch's input through its own checks); None: open_source(cfg.input)."""
    if limit is not None and limit < 0:
        raise JobError(f"--limit: must be >= 0, got {limit}")
    if retry_errors and (not resume or limit is not None):
        raise JobError(f"--retry-errors: not with {'--no-resume' if not resume else '--limit'} (it retries the "
                       "rows with an error of a complete output, and keeps every other row)")
    if cfg.executor["kind"] == "ray":
        check_ray()
    model = check_model(cfg)
    check_structured_outputs(cfg, model)
    source = source if source is not None else open_source(cfg.input)
    if source.format != "openai-batch":  # an OpenAI batch's requests say their endpoint, checked line by line
        check_task(cfg, model)
    inp = cfg.input
    id_column = inp["id_column"]
    if source.format == "openai-batch":
        if cfg.task != "generate":
            raise JobError(f"task: {cfg.task} reads rows of texts; openai-batch input holds requests (a completions "
                           "request with echo, logprobs and max_tokens 0 scores its prompt)")
        id_column = None
        for key in ("prompt_column", "messages_column", "id_column", "keep_columns", "sampling_columns"):
            if f"input.{key}" in cfg.explicit and inp[key]:
                raise JobError(f"input.{key}: not used with openai-batch input (each request's body says "
                               "its prompt or messages and its sampling values; custom_id is the id)")
    else:
        if cfg.task == "loglikelihood":
            text_keys = ["context_column", "continuation_column"]
        elif cfg.task == "score":
            text_keys = ["text_1_column", "text_2_column"]
        else:
            text_keys = ["messages_column" if inp["messages_column"] else "prompt_column"]
        for text_key in text_keys:
            _need_column(source, inp[text_key], f"input.{text_key}")
        if id_column and not source.has_column(id_column):
            if "input.id_column" in cfg.explicit:
                _need_column(source, id_column, "input.id_column")
            id_column = None  # the default "id" is optional: ids are then the row numbers
        for c in inp["keep_columns"]:
            _need_column(source, c, "input.keep_columns")
        for name, c in inp["sampling_columns"].items():
            _need_column(source, c, f"input.sampling_columns.{name}")
    out_dir = Path(cfg.output["path"])
    if shard is not None:
        out_dir = out_dir / shard.dirname
    check_output_dir(out_dir)
    inside = Path(os.path.abspath(out_dir))
    top = Path(os.path.abspath(inp["path"]))
    if os.path.isdir(top) and (inside == top or top in inside.parents):
        raise JobError(f"output.path: {out_dir} is inside the input folder {inp['path']}; "
                       "a rerun would read its own output")
    fingerprint = {"version": FINGERPRINT_VERSION,
                   "model": {k: cfg.model[k] for k in ("path", "dtype", "max_model_len")},
                   "input": _input_fingerprint(cfg, source), "sampling": cfg.sampling,
                   "output": {k: cfg.output[k] for k in ("include_prompt", "include_token_ids")},
                   "shard": str(shard) if shard else None}
    if cfg.task != "generate":  # absent for generation: outputs written before the key existed resume
        fingerprint["task"] = cfg.task
    for key in NUMERICS_KEYS:
        section, name = key.split(".")
        value = getattr(cfg, section)[name]
        if value != EngineArgs.__dataclass_fields__[field_of(key)].default:
            fingerprint.setdefault(section, {})[name] = value
    target = OutputTarget(out_dir, _output_spec(cfg, source, id_column, model), cfg.output["rows_per_part"], fingerprint,
                          openai=source.format == "openai-batch")
    plan = JobPlan(cfg=cfg, source=source, shard=shard, limit=limit, output=target, id_column=id_column, model=model,
                   resume=resume, retry_errors=retry_errors)
    _plan_slice(plan)
    plan.status = read_status(target, resume=resume, retry_errors=retry_errors)
    if plan.status.state != "complete":
        plan.kv_cache_tokens = job_kv_tokens(plan)
    return plan


def _need_column(source: Source, column: str, key: str) -> None:
    if not source.has_column(column):
        cols = ", ".join(source.columns or [])
        raise JobError(f"{key}: column {column!r} not found in {source.path} (columns: {cols})")


def _plan_slice(plan: JobPlan) -> None:
    source, shard = plan.source, plan.shard
    n = source.count_rows() if shard is not None and shard.count > 1 else source.num_rows()
    if shard is not None and shard.count > 1:
        if n is None:
            plan.strided = True  # row count unknown (a streamed hub dataset): take every N-th row
        else:
            plan.lo, plan.hi = n * shard.index // shard.count, n * (shard.index + 1) // shard.count
    elif n is not None:
        plan.hi = n
    total = None if plan.hi is None else plan.hi - plan.lo
    if plan.limit is not None:
        total = plan.limit if total is None else min(total, plan.limit)
    plan.total = total


# ---------------------------------------------------------------- what the rows need of the KV cache

# Rows read to find the longest prompt before anything loads: a longer prompt later in the input still runs
# (the pool holds max_num_seqs such rows; a row that exceeds the whole pool is a row error, as before).
KV_SAMPLE_ROWS = 10_000
# Tokens a chat template may add to a row's messages beyond their JSON text (a system header and role tags).
TEMPLATE_TOKENS = 64


def _prompt_bytes(row: dict[str, Any], key: str | None) -> int:
    """An upper bound of a row's prompt tokens: its UTF-8 bytes (a byte-level BPE or SentencePiece token covers at
    least one byte), its messages as JSON text (which outgrows the template's own tags), or its token ids."""
    value = row.get(key) if key is not None else row.get("messages", row.get("prompt"))
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list) and all(isinstance(t, int) for t in value):
        return len(value)
    return len(json.dumps(value, default=str).encode()) + TEMPLATE_TOKENS


def job_kv_tokens(plan: JobPlan) -> int | None:
    """Tokens the KV pool needs for this run's rows: the sequences that run at once (max_num_seqs, or all the rows'
    samples if fewer) times the longest (its prompt's bytes, an upper bound of its tokens, found among the first
    KV_SAMPLE_ROWS rows, plus max_tokens and room for drafts), each bounded by max_model_len. None when a row's
    length has no bound here (max_tokens unset or per row, and the model's context unknown): LLM's default."""
    cfg = plan.cfg
    sampling, columns = cfg.sampling, cfg.input["sampling_columns"]
    max_len = cfg.model["max_model_len"] or (plan.model.max_position_embeddings if plan.model else None)
    max_tokens = sampling.get("max_tokens", SamplingParams().max_tokens)
    if cfg.task != "generate":
        max_tokens, columns = 0, {}  # a scored or pooled row is its prompt alone
    n = 1 if "n" in columns else int(sampling.get("n", 1))
    rows = None if plan.total is None else max(0, plan.total - plan.status.committed)
    seqs = min(cfg.engine["max_num_seqs"], rows * n if rows is not None else cfg.engine["max_num_seqs"])
    if seqs == 0:
        return None
    longest = 0
    if max_tokens is not None and "max_tokens" not in columns:
        if plan.source.format == "openai-batch":
            keys: list[str | None] = [None]
        elif cfg.task == "loglikelihood":  # a context and its continuation (and a token for an empty context)
            keys = [cfg.input["context_column"], cfg.input["continuation_column"]]
        elif cfg.task == "score":
            keys = [cfg.input["text_1_column"], cfg.input["text_2_column"]]
        else:
            keys = [cfg.input["messages_column"] or cfg.input["prompt_column"]]
        read = 0
        try:
            for batch in plan.row_slice(plan.status.committed).read(plan.source, keys if keys[0] else None):
                longest = max([longest, *(len(keys) - 1 + sum(_prompt_bytes(row, k) for k in keys)
                                          for _, _, row in batch)])
                read += len(batch)
                if read >= KV_SAMPLE_ROWS:
                    break
        except Exception:  # noqa: BLE001 - an input the run will report row by row: no estimate from it
            log.debug("no KV estimate from the input", exc_info=True)
            longest = None
        per_seq = None if longest is None else longest + max_tokens + 2 * cfg.engine["block_size"] + 8
    else:
        per_seq = None
    if max_len is not None:
        per_seq = max_len if per_seq is None else min(per_seq, max_len)
    if per_seq is None:
        return None
    if cfg.task in POOLED_TASKS:  # its requests end with their prompts
        engine = cfg.engine
        return min(seqs * per_seq, prompt_only_kv_tokens(engine["max_num_batched_tokens"], per_seq,
                                                         engine["max_num_seqs"], engine["block_size"]))
    return seqs * per_seq


def _output_spec(cfg: JobConfig, source: Source, id_column: str | None, model: ModelSource) -> OutputSpec:
    sampling_cols = cfg.input["sampling_columns"]
    types = source.arrow_types()
    spec = OutputSpec(
        keep_columns=list(cfg.input["keep_columns"]), known_types=types,
        id_type=types.get(id_column) if id_column else None,
        include_prompt=cfg.output["include_prompt"], include_token_ids=cfg.output["include_token_ids"],
        sample_index=cfg.sampling.get("n", 1) > 1 or "n" in sampling_cols,
        logprobs=cfg.sampling.get("logprobs") is not None or "logprobs" in sampling_cols,
        prompt_logprobs=cfg.sampling.get("prompt_logprobs") is not None or "prompt_logprobs" in sampling_cols,
        truncated_tokens=cfg.input["on_too_long"].startswith("truncate"), model=cfg.model["path"], task=cfg.task,
        embedding_dtype=cfg.pooling["embedding_dtype"], labels=_labels(model) if cfg.task == "classify" else [])
    if id_column is None and source.format != "openai-batch":
        spec.id_type = pa.int64()
    return spec


def describe_plan(plan: JobPlan) -> str:
    src = plan.source
    rows = plan.total if plan.total is not None else "?"
    what = {"fresh": "starts afresh", "resume": f"resumes after {plan.status.committed} committed rows",
            "complete": "is already complete", "retry": "retries its rows with an error"}[plan.status.state]
    if plan.status.damaged:
        what += f"; damaged parts computed again: {', '.join(plan.status.damaged)}"
    shard = f", shard {plan.shard}" if plan.shard else ""
    ex = plan.cfg.executor
    n = ex["replicas"]
    on = f"; on Ray ({n} replica{'s' * (n != 1)}, {ex['address'] or 'a local Ray'})" if ex["kind"] == "ray" else ""
    model = plan.cfg.model["path"]
    if plan.model is not None and plan.model.hub_id:
        model += f" (from the Hugging Face cache: {plan.model.path})"
    task = f"; task {plan.cfg.task}" if plan.cfg.task != "generate" else ""
    return (f"ok: model {model}; input {src.path} ({src.format}, {rows} rows{shard}); "
            f"output {plan.out_dir} {what}{on}{task}")
