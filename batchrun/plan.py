"""plan_job(): everything about a job that can be checked without the model, and how its rows are sliced.

Checks the model and engine settings against this machine and where the model path points (the same checks
LLM makes, batchrun.model.weights.locate), opens the input (readable, the columns exist), picks this shard's slice of
rows, checks the output folder is writable and whether it holds committed rows of this same job (resume) or of
another one (refused, exit 2). Nothing is loaded, nothing is written.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.config import EngineSettings, JobConfig, JobError
from batchrun.engine_args import EngineArgs, EngineArgsError, field_of, job_key
from batchrun.output.openai_sink import OpenAIBatchSink
from batchrun.output.sinks import (
    AHEAD,
    AHEAD_JSONL,
    PROGRESS,
    SUCCESS,
    OutputSpec,
    ParquetSink,
    Sink,
    SinkError,
    fingerprint_hash,
    part_files,
    read_job_file,
)
from batchrun.io.sources import Source, open_source
from batchrun.model.errors import ModelLoadError
from batchrun.model.weights.locate import ModelSource, locate_model
from batchrun.io.slicing import RowSlice
from batchrun.sampling_params import SamplingParams
from batchrun.shards import ShardSpec

__all__ = ["ShardSpec", "JobPlan", "plan_job", "plan_resume", "make_sink", "describe_plan"]

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
    args = cfg.engine_args()
    try:
        args.check_environment()
        source = locate_model(args.model)
        source.check_max_model_len(args.max_model_len)
        source.check_quantization(args.quantization)
        source.check_calibration(args.calibration)
    except EngineArgsError as e:
        raise JobError(f"{job_key(e.field) or e.field}: {e.problem}") from None
    except ModelLoadError as e:
        raise JobError(f"model.path: {e}") from None
    return source


def check_structured_outputs(cfg: JobConfig, model: ModelSource) -> None:
    """The job-level structured output compiles, with the model's tokenizer alone (no weights): a bad
    schema, regex or grammar, or one that overruns engine.grammar_compile_timeout_s, is exit 2 now."""
    spec = cfg.sampling.get("structured_outputs")
    if spec is None:
        return
    from batchrun.model.weights.loader import eos_ids, load_config, load_tokenizer, resolve_path
    from batchrun.sampling_params import SamplingParams

    try:
        from batchrun.structured.compiler import StructuredOutputs
    except ImportError as e:
        raise JobError(f"sampling.structured_outputs: {e}") from None

    try:
        path = resolve_path(model.load_spec)
        config, tokenizer = load_config(path), load_tokenizer(path)
    except (ModelLoadError, OSError, ValueError) as e:
        raise JobError(f"model.path: cannot read the tokenizer for sampling.structured_outputs: "
                       f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    compiler = StructuredOutputs(tokenizer, config.vocab_size, eos_ids(path, config, tokenizer),
                                 timeout_s=cfg.engine["grammar_compile_timeout_s"])
    why = compiler.check(SamplingParams(structured_outputs=spec).structured_outputs)
    if why:
        raise JobError(f"sampling.structured_outputs: {why}")


def check_output_dir(path: Path) -> None:
    """The folder exists and is writable, or can be created."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        raise JobError(f"output.path: {path} cannot be created: {p} is not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise JobError(f"output.path: {path} is not writable ({p} is read-only for this user)")


def probe_output_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}.batchrun-tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise JobError(f"output.path: {path} is not writable ({e.strerror or e})") from None


# ---------------------------------------------------------------- plan


@dataclass
class JobPlan:
    cfg: JobConfig
    source: Source
    shard: ShardSpec | None
    limit: int | None
    out_dir: Path
    fingerprint: dict[str, Any]
    id_column: str | None
    model: ModelSource | None = None  # where model.path points (checked, nothing loaded)
    lo: int = 0  # global index of this shard's first row (contiguous slices)
    hi: int | None = None  # one past its last row (None: to the end)
    strided: bool = False  # slice i % N == I instead (when the row count is unknown)
    resume: bool = True  # False: --no-resume (start afresh whatever is committed)
    retry_errors: bool = False  # --retry-errors: compute again the rows of a complete output with an error
    state: str = "fresh"  # fresh | resume | complete | retry
    damaged: list[str] = field(default_factory=list)  # committed parts found damaged (computed again)
    accepted: frozenset[str] = frozenset()  # earlier fingerprints of this output's parts (kept by a retry)
    checksums: str = "last"  # parts whose checksum the run checks: "last" on a resume, "all" on a complete output
    unrecorded: int = 0  # sound parts the manifest has no entry for (the run records them)
    committed: int = 0  # input rows already committed
    total: int | None = None  # rows this shard covers (after --limit), when known
    notes: list[str] = field(default_factory=list)
    kv_cache_tokens: int | None = None  # what the run's rows need of the KV pool (job_kv_tokens), None: unknown

    @property
    def fp_hash(self) -> str:
        return fingerprint_hash(self.fingerprint)


def _input_fingerprint(cfg: JobConfig, source: Source) -> dict[str, Any]:
    inp = cfg.input
    fp = {**source.identity(), "prompt_column": inp["prompt_column"], "messages_column": inp["messages_column"],
          "id_column": inp["id_column"], "keep_columns": inp["keep_columns"],
          "sampling_columns": inp["sampling_columns"], "on_error": inp["on_error"]}
    if inp["on_too_long"] != "error":  # absent at its default: outputs written before the key existed resume
        fp["on_too_long"] = inp["on_too_long"]
    return fp


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _describe_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    a, b = _flatten(old), _flatten(new)
    diffs = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
             if a.get(k) != b.get(k) and k != "version"]
    return "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "") or "unknown change"


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
    inp = cfg.input
    id_column = inp["id_column"]
    if source.format == "openai-batch":
        id_column = None
        for key in ("prompt_column", "messages_column", "id_column", "keep_columns", "sampling_columns"):
            if f"input.{key}" in cfg.explicit and inp[key]:
                raise JobError(f"input.{key}: not used with openai-batch input (each request's body says "
                               "its prompt or messages and its sampling values; custom_id is the id)")
    else:
        text_key = "messages_column" if inp["messages_column"] else "prompt_column"
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
    for key in NUMERICS_KEYS:
        section, name = key.split(".")
        value = getattr(cfg, section)[name]
        if value != EngineArgs.__dataclass_fields__[field_of(key)].default:
            fingerprint.setdefault(section, {})[name] = value
    plan = JobPlan(cfg=cfg, source=source, shard=shard, limit=limit, out_dir=out_dir,
                   fingerprint=fingerprint, id_column=id_column, model=model, resume=resume,
                   retry_errors=retry_errors)
    _plan_slice(plan)
    plan_resume(plan)
    if plan.state != "complete":
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


def plan_resume(plan: JobPlan) -> None:
    """What the output folder holds: fresh, resume (after plan.committed rows), complete, or retry
    (--retry-errors on a complete output). Run once when planning and again by the run once it holds the
    folder's lock (another run may have written since). The parts are checked against their manifest here
    (batchrun.output.manifest): a damaged part makes a complete output resume, to compute it again."""
    out = plan.out_dir
    plan.damaged = []
    if not plan.resume:
        plan.state = "fresh"
        return
    old = read_job_file(out)
    committed_parts = bool(part_files(out)) or any((out / name).exists() for name in (PROGRESS, AHEAD, AHEAD_JSONL))
    if not committed_parts:
        if plan.retry_errors:
            raise JobError(f"--retry-errors: {out} holds no output yet; run the job without it first")
        plan.state = "fresh"
        return
    earlier = set(old.get("earlier_fingerprints", [])) if old else set()
    if old is not None and fingerprint_hash(old.get("fingerprint", {})) != plan.fp_hash:
        changes = _describe_changes(old.get("fingerprint", {}), plan.fingerprint)
        if not plan.retry_errors:
            raise JobError(f"output.path: {out} holds rows of a different job ({changes}); rerun with "
                           "--no-resume to start afresh, or choose another output.path")
        earlier.add(fingerprint_hash(old.get("fingerprint", {})))  # a job fixed before retrying its errors
        note = f"the job changed since the output was written ({changes}); the rows with an error are " \
               "computed again with the new one"
        if note not in plan.notes:
            plan.notes.append(note)
    plan.accepted = frozenset(earlier - {plan.fp_hash})
    # A resume must start fast, and what an interruption can damage is the last part; a complete output is
    # checked whole (docs/durability.md: "What a rerun checks").
    plan.checksums = "all" if (out / SUCCESS).exists() else "last"
    sink = make_sink(plan)
    try:
        counts = sink.scan()
    except SinkError as e:
        raise JobError(f"output.path: cannot resume: {e}") from None
    inspection = getattr(sink, "inspection", None)
    plan.damaged = [f"{p.path.name} ({p.damage})" for p in inspection.damaged] if inspection else []
    plan.unrecorded = len(inspection.unrecorded()) if inspection else 0
    plan.committed = counts.end
    done = (out / SUCCESS).exists()
    if plan.retry_errors:
        if plan.source.format == "openai-batch":
            raise JobError("--retry-errors: not available for openai-batch output yet (Parquet outputs only)")
        if not done:
            raise JobError(f"--retry-errors: {out} is not complete (no _SUCCESS); run the job without "
                           "--retry-errors to finish it first")
        plan.state = "retry"
    else:
        plan.state = "complete" if done and not plan.damaged else "resume"


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
    n = 1 if "n" in columns else int(sampling.get("n", 1))
    rows = None if plan.total is None else max(0, plan.total - plan.committed)
    seqs = min(cfg.engine["max_num_seqs"], rows * n if rows is not None else cfg.engine["max_num_seqs"])
    if seqs == 0:
        return None
    longest = 0
    if max_tokens is not None and "max_tokens" not in columns:
        key = None if plan.source.format == "openai-batch" else \
            (cfg.input["messages_column"] or cfg.input["prompt_column"])
        read = 0
        try:
            for batch in RowSlice.of_plan(plan, plan.committed).read(plan.source, [key] if key else None):
                longest = max([longest, *(_prompt_bytes(row, key) for _, _, row in batch)])
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
    return None if per_seq is None else seqs * per_seq


def make_sink(plan: JobPlan) -> Sink:
    cfg, source = plan.cfg, plan.source
    sampling_cols = cfg.input["sampling_columns"]
    types = source.arrow_types()
    spec = OutputSpec(
        keep_columns=list(cfg.input["keep_columns"]), known_types=types,
        id_type=types.get(plan.id_column) if plan.id_column else None,
        include_prompt=cfg.output["include_prompt"], include_token_ids=cfg.output["include_token_ids"],
        sample_index=cfg.sampling.get("n", 1) > 1 or "n" in sampling_cols,
        logprobs=cfg.sampling.get("logprobs") is not None or "logprobs" in sampling_cols,
        truncated_tokens=cfg.input["on_too_long"].startswith("truncate"), model=cfg.model["path"])
    if plan.id_column is None and source.format != "openai-batch":
        spec.id_type = pa.int64()
    cls = OpenAIBatchSink if source.format == "openai-batch" else ParquetSink
    sink = cls(plan.out_dir, spec, cfg.output["rows_per_part"], plan.fp_hash)
    sink.accepted, sink.checksums = plan.accepted, plan.checksums
    return sink


def describe_plan(plan: JobPlan) -> str:
    src = plan.source
    rows = plan.total if plan.total is not None else "?"
    what = {"fresh": "starts afresh", "resume": f"resumes after {plan.committed} committed rows",
            "complete": "is already complete", "retry": "retries its rows with an error"}[plan.state]
    if plan.damaged:
        what += f"; damaged parts computed again: {', '.join(plan.damaged)}"
    shard = f", shard {plan.shard}" if plan.shard else ""
    ex = plan.cfg.executor
    n = ex["replicas"]
    on = f"; on Ray ({n} replica{'s' * (n != 1)}, {ex['address'] or 'a local Ray'})" if ex["kind"] == "ray" else ""
    model = plan.cfg.model["path"]
    if plan.model is not None and plan.model.hub_id:
        model += f" (from the Hugging Face cache: {plan.model.path})"
    return (f"ok: model {model}; input {src.path} ({src.format}, {rows} rows{shard}); "
            f"output {plan.out_dir} {what}{on}")
