"""Input readers, as streams: Parquet, JSONL, OpenAI batch files (Hugging Face datasets: hf_datasets.py).

`open_source` reads no more than footers, metadata or the first line. A row that cannot be parsed (a bad JSON
line) comes through as ``{ROW_ERROR: "why"}``: a row error, not a failed job."""

from __future__ import annotations

import glob as globlib
import gzip
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.config import JobError
from batchrun.io.base import Row, Source, one_line, size_of

log = logging.getLogger(__name__)

ROW_ERROR = "__batchrun_row_error__"
FORMATS = ("parquet", "jsonl", "dataset", "openai-batch")
BATCH_BYTES = 8 * 2**20  # a read batch holds about this much input (rows are also capped by batch_size)
MIN_BATCH_ROWS = 8
PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json", ".jsonl.gz", ".ndjson.gz", ".json.gz")

# ---------------------------------------------------------------- format inference and opening


def _expand_files(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """A file, a folder (searched recursively, skipping _ and . names) or a glob -> sorted files."""
    if any(c in path for c in "*?["):
        return sorted(p for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
    if os.path.isdir(path):
        out = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
            out += [os.path.join(root, f) for f in files
                    if f.lower().endswith(suffixes) and not f.startswith(("_", "."))]
        return sorted(out)
    return [path]


def _is_dataset_dir(path: str) -> bool:
    p = Path(path)
    return (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file())


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _first_json_line(path: str) -> tuple[int, Any] | None:
    """(line number, parsed object) of the first non-blank line; JobError if it is not JSON."""
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        return lineno, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise JobError(f"input.path: {path} line {lineno} is not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise JobError(f"input.path: cannot read {path}: {e}") from None
    return None


def _looks_like_openai_batch(obj: Any) -> bool:
    return isinstance(obj, dict) and "custom_id" in obj and isinstance(obj.get("body"), dict)


def infer_format(path: str) -> str:
    lower = path.lower()
    if os.path.isdir(path):
        if _is_dataset_dir(path):
            return "dataset"
        if _expand_files(path, PARQUET_SUFFIXES):
            return "parquet"
        jsonl = _expand_files(path, JSONL_SUFFIXES)
        if jsonl:
            first = _first_json_line(jsonl[0])
            return "openai-batch" if first and _looks_like_openai_batch(first[1]) else "jsonl"
        raise JobError(f"input.path: {path} is a folder with no Parquet or JSONL files and no saved dataset")
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        if any(c in path for c in "*?["):
            files = _expand_files(path, JSONL_SUFFIXES)
            first = _first_json_line(files[0]) if files else None
        else:
            first = _first_json_line(path) if os.path.isfile(path) else None
        return "openai-batch" if first and _looks_like_openai_batch(first[1]) else "jsonl"
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) == b"PAR1":
                return "parquet"
        first = _first_json_line(path)
        return "openai-batch" if first and _looks_like_openai_batch(first[1]) else "jsonl"
    raise JobError(f"input.path: cannot tell the format of {path!r} (it does not exist, and has no .parquet or "
                   ".jsonl suffix); set input.format (dataset for a Hugging Face hub dataset)")


def open_source(inp: dict[str, Any]) -> Source:
    """Check the input (not the columns) and return a Source. Raises JobError naming input.* keys."""
    path = inp["path"]
    fmt = inp["format"]
    globbed = any(c in path for c in "*?[")
    exists = os.path.exists(path)
    if not exists and not globbed and fmt != "dataset":
        raise JobError(f"input.path: {path} does not exist")
    if inp.get("data_files") is not None and fmt not in (None, "dataset"):
        raise JobError("input.data_files: only used with format: dataset (a load_dataset builder)")
    if fmt is None:
        fmt = "dataset" if inp.get("data_files") is not None else infer_format(path)
    if fmt == "parquet":
        return ParquetSource(path)
    if fmt == "jsonl":
        return JsonlSource(path)
    if fmt == "openai-batch":
        return OpenAIBatchSource(path)
    from batchrun.io.hf_datasets import DiskDatasetSource, HubDatasetSource

    if exists and os.path.isdir(path) and _is_dataset_dir(path):
        return DiskDatasetSource(path, inp["split"])
    if exists and os.path.isdir(path) and inp.get("data_files") is None:
        raise JobError(f"input.path: {path} is not a saved dataset (no dataset_info.json / dataset_dict.json); "
                       "for files, use format: parquet or jsonl")
    return HubDatasetSource(path, inp["split"], inp.get("data_files"))


# ---------------------------------------------------------------- Parquet


class ParquetSource(Source):
    format = "parquet"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.files = _expand_files(path, PARQUET_SUFFIXES)
        if not self.files:
            raise JobError(f"input.path: no Parquet files match {path}")
        self._row_groups: list[list[int]] = []  # per file, rows per row group
        schema = None
        for f in self.files:
            try:
                meta = pq.read_metadata(f)
                file_schema = meta.schema.to_arrow_schema()
            except (OSError, pa.ArrowException) as e:
                raise JobError(f"input.path: {f} is not a readable Parquet file ({one_line(e)})") from None
            self._row_groups.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
            if schema is None:
                schema = file_schema
            else:
                missing = [n for n in schema.names if n not in file_schema.names]
                if missing:
                    raise JobError(f"input.path: {f} lacks column(s) {', '.join(missing)} that {self.files[0]} has")
        self.schema: pa.Schema = schema
        self.columns = list(schema.names)
        self._row_bytes = _bytes_per_row(self.files[0])

    def arrow_types(self) -> dict[str, pa.DataType]:
        return {f.name: f.type for f in self.schema}

    def num_rows(self) -> int:
        return sum(sum(g) for g in self._row_groups)

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "files": len(self.files), "bytes": size_of(self.files)}

    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        # Wide rows get smaller batches, so a batch stays near BATCH_BYTES however wide the rows are.
        row_bytes = sum(v for k, v in self._row_bytes.items() if columns is None or k in columns)
        batch_size = max(MIN_BATCH_ROWS, min(batch_size, BATCH_BYTES // max(row_bytes, 1)))
        offset = 0  # global index of the next row group's first row
        for f, groups in zip(self.files, self._row_groups):
            wanted, skip = [], 0
            for gi, n in enumerate(groups):
                if offset + n <= start:
                    offset += n
                    continue
                if not wanted:
                    skip = max(0, start - offset)
                wanted.append(gi)
                offset += n
            if not wanted:
                continue
            try:
                pf = pq.ParquetFile(f)
                batches = pf.iter_batches(batch_size=batch_size, row_groups=wanted, columns=columns,
                                          use_threads=False)
                for batch in batches:
                    if skip:
                        if skip >= batch.num_rows:
                            skip -= batch.num_rows
                            continue
                        batch = batch.slice(skip)
                        skip = 0
                    yield batch.to_pylist()
            except (OSError, pa.ArrowException) as e:
                raise InputReadError(f"reading {f}: {one_line(e)}") from e


def _bytes_per_row(path: str) -> dict[str, int]:
    """Uncompressed bytes per row of each top-level column, from the first row group's metadata."""
    try:
        meta = pq.read_metadata(path)
        if meta.num_row_groups == 0:
            return {}
        rg = meta.row_group(0)
        out: dict[str, int] = {}
        for i in range(rg.num_columns):
            col = rg.column(i)
            name = col.path_in_schema.split(".")[0]
            out[name] = out.get(name, 0) + col.total_uncompressed_size // max(rg.num_rows, 1)
        return out
    except (OSError, pa.ArrowException):
        return {}


class InputReadError(RuntimeError):
    """The input became unreadable during the run (exit 1; the committed rows are kept)."""


# ---------------------------------------------------------------- JSONL


class JsonlSource(Source):
    format = "jsonl"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.files = _expand_files(path, JSONL_SUFFIXES)
        if not self.files:
            raise JobError(f"input.path: no JSONL files match {path}")
        first = None
        for f in self.files:
            if not os.path.isfile(f):
                raise JobError(f"input.path: {f} does not exist")
            first = first or _first_json_line(f)
        if first is not None:
            lineno, obj = first
            if not isinstance(obj, dict):
                raise JobError(f"input.path: {self.files[0]} line {lineno}: each line must be a JSON object, "
                               f"got {type(obj).__name__}")
            self.columns = self._columns_of(obj)
        else:
            self.columns = None  # empty input: nothing to check, nothing to do

    def _columns_of(self, obj: dict) -> list[str]:
        return list(obj)

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "files": len(self.files), "bytes": size_of(self.files)}

    def num_rows(self) -> int | None:
        # Counting lines is cheap for small inputs only; larger ones show progress without a total.
        return self.count_rows() if size_of(self.files) <= 32 * 2**20 else None

    def has_column(self, name: str) -> bool:
        # JSONL has no schema: the first row stands for it; a later row without the column is a row error.
        return self.columns is None or name in self.columns

    def count_rows(self) -> int:
        n = 0
        for f in self.files:
            opener = gzip.open if f.endswith(".gz") else open
            with opener(f, "rb") as fh:
                n += sum(1 for line in fh if line.strip())
        return n

    def _parse(self, line: str, where: str) -> Row:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            return {ROW_ERROR: f"{where}: invalid JSON ({e.msg})"}
        if not isinstance(obj, dict):
            return {ROW_ERROR: f"{where}: expected a JSON object, got {type(obj).__name__}"}
        return obj

    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        index, batch, nbytes = 0, [], 0
        for f in self.files:
            try:
                with _open_text(f) as fh:
                    for lineno, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        index += 1
                        if index <= start:
                            continue
                        row = self._parse(line, f"{os.path.basename(f)} line {lineno}")
                        if columns is not None and ROW_ERROR not in row:
                            row = {c: row.get(c) for c in columns if c in row}
                        batch.append(row)
                        nbytes += len(line)
                        if len(batch) >= batch_size or nbytes >= BATCH_BYTES:
                            yield batch
                            batch, nbytes = [], 0
            except (OSError, UnicodeDecodeError, EOFError) as e:
                raise InputReadError(f"reading {f}: {one_line(e)}") from e
        if batch:
            yield batch


# ---------------------------------------------------------------- OpenAI batch


OPENAI_FIELD_MAP = {"max_completion_tokens": "max_tokens"}
POOLING_URLS = ("/v1/embeddings", "/v1/score", "/v1/rerank")  # (io/openai_pooling.py reads their bodies)


def _response_format(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """OpenAI's response_format -> (structured_outputs fields, None) or (None, why not). `text` is no
    constraint; `json_schema` takes its `json_schema.schema`; `json_object` is any JSON object."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        return None, "expected {type: text | json_object | json_schema, ...}"
    kind = value["type"]
    if kind == "text":
        return None, None
    if kind == "json_object":
        return {"json_object": True}, None
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            return None, "json_schema needs a `schema` object ({type: json_schema, json_schema: {name, schema}})"
        return {"json": schema}, None
    return None, f"unsupported type {kind!r} (text, json_object or json_schema)"


class OpenAIBatchSource(JsonlSource):
    """OpenAI batch lines {custom_id, url, body} as rows {custom_id, url, model, prompt | messages, sampling, echo}:
    the body's SamplingParams fields (and max_completion_tokens, logprobs / top_logprobs) are per-row sampling.
    A completion's `echo: true` puts the prompt before the answer; with `logprobs: k` it asks the prompt's
    log-probabilities too (prompt_logprobs k), which is how clients score a continuation (`max_tokens: 0`)."""

    format = "openai-batch"
    COLUMNS = ["custom_id", "url", "model", "prompt", "messages", "sampling", "echo"]

    def _columns_of(self, obj: dict) -> list[str]:
        return list(self.COLUMNS)

    def _parse(self, line: str, where: str) -> Row:
        from batchrun.sampling_params import SamplingParams

        obj = super()._parse(line, where)
        if ROW_ERROR in obj:
            return obj
        cid = obj.get("custom_id")
        body = obj.get("body")
        if not isinstance(body, dict):
            return {ROW_ERROR: f"{where}: missing the request body", "custom_id": cid}
        url = obj.get("url") or ("/v1/chat/completions" if "messages" in body else "/v1/completions")
        if url in POOLING_URLS:  # its body is read by io/openai_pooling.py
            return {"custom_id": cid, "url": url, "model": body.get("model"), "pooling_body": body}
        names = set(SamplingParams.field_names()) - {"logprobs", "prompt_logprobs"}  # from logprobs and echo
        sampling = {}
        for k, v in body.items():
            k = OPENAI_FIELD_MAP.get(k, k)
            if k in names:
                sampling[k] = v
        lp = body.get("logprobs")
        if lp is True:  # chat's: the top_logprobs most likely
            sampling["logprobs"] = body.get("top_logprobs") or 0
        elif lp is not None and lp is not False:  # the completions' count (0: the token's own only)
            sampling["logprobs"] = lp
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            return {ROW_ERROR: f"{where}: body.echo must be true or false, got {echo!r}", "custom_id": cid}
        if echo and url != "/v1/completions":
            return {ROW_ERROR: f"{where}: body.echo is for /v1/completions only", "custom_id": cid}
        if echo and "logprobs" in sampling:
            sampling["prompt_logprobs"] = sampling["logprobs"]
        if body.get("response_format") is not None:
            structured, why = _response_format(body["response_format"])
            if why:
                return {ROW_ERROR: f"{where}: response_format: {why}", "custom_id": cid}
            if structured is not None:
                sampling["structured_outputs"] = structured
        row = {"custom_id": cid, "url": url, "model": body.get("model"), "sampling": sampling}
        if echo:
            row["echo"] = True
        if "messages" in body:
            row["messages"] = body["messages"]
        else:
            row["prompt"] = body.get("prompt")
        return row

    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        yield from super().iter_rows(start, None, batch_size)
