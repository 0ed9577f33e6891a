"""`batchrun show OUTPUT`: the first rows of an output folder as a table a person reads in a terminal.

OUTPUT: a job's Parquet folder, a folder of job-array shards (a `shard` column), or an OpenAI batch output folder.
Only the rows shown are read. Default columns: id, question (a chat's last user message, else the prompt), the
completion (a loglikelihood job's `logprob`, `is_greedy`, `num_tokens`), and a shown row's error."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchrun.config import JobError
from batchrun.output.folder import OPENAI_OUTPUT, SHARD_RE
from batchrun.output.parts import part_files

QUESTION_COLUMNS = ("messages", "prompt")  # the first one present is shown as the question
SCORE_COLUMNS = ("logprob", "is_greedy", "num_tokens")  # a loglikelihood job's answer


def output_folders(output: Path) -> list[tuple[str | None, Path]]:
    """(shard name or None, folder) holding part files, in reading order."""
    if not output.is_dir():
        raise JobError(f"{output} is not an output folder")
    if part_files(output):
        return [(None, output)]
    shards = sorted((int(m.group(2)), int(m.group(1)), p) for p in output.iterdir()
                    if p.is_dir() and (m := SHARD_RE.match(p.name)) and part_files(p))
    if not shards:
        raise JobError(f"{output} holds no committed rows (no part-NNNNN.parquet files, nor shard folders "
                       "holding them)")
    return [(p.name, p) for _, _, p in shards]


def read_rows(output: Path, n: int, columns: list[str] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """The available column names and the first `n` rows (of `columns`, or all), reading no more parts
    than needed."""
    if (output / OPENAI_OUTPUT).is_file():
        return _openai_rows(output / OPENAI_OUTPUT, n, columns)
    folders = output_folders(output)
    names = pq.read_schema(part_files(folders[0][1])[0]).names
    if folders[0][0] is not None:
        names = ["shard", *names]
    if columns:
        unknown = [c for c in columns if c not in names]
        if unknown:
            raise JobError(f"no column {', '.join(map(repr, unknown))} in {output}; its columns: {', '.join(names)}")
    rows: list[dict[str, Any]] = []
    for shard, folder in folders:
        for row in _rows_of(folder, [c for c in (columns or names) if c != "shard"]):
            if len(rows) >= n:
                return names, rows
            rows.append({"shard": shard, **row} if shard is not None else row)
    return names, rows


def _openai_rows(path: Path, n: int, columns: list[str] | None) -> tuple[list[str], list[dict[str, Any]]]:
    """The first `n` lines of an OpenAI batch output file, flattened to custom_id / completion / error."""
    names = ["custom_id", "status_code", "completion", "finish_reason", "error"]
    unknown = [c for c in columns or [] if c not in names]
    if unknown:
        raise JobError(f"no column {', '.join(map(repr, unknown))} in {path}; its columns: {', '.join(names)}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(rows) >= n or not line.endswith("\n"):  # a line without its newline is not committed
                break
            response = json.loads(line).get("response") or {}
            body = response.get("body") or {}
            choice = (body.get("choices") or [{}])[0]
            text = (choice.get("message") or {}).get("content", choice.get("text"))
            rows.append({"custom_id": json.loads(line).get("custom_id"), "status_code": response.get("status_code"),
                         "completion": text, "finish_reason": choice.get("finish_reason"),
                         "error": (body.get("error") or {}).get("message")})
    return names, rows


def _rows_of(folder: Path, columns: list[str]) -> Iterator[dict[str, Any]]:
    for part in part_files(folder):
        f = pq.ParquetFile(part)
        present = [c for c in columns if c in f.schema_arrow.names]
        for batch in f.iter_batches(batch_size=64, columns=present):
            yield from batch.to_pylist()


def default_columns(names: list[str], rows: list[dict[str, Any]]) -> list[str]:
    cols = [c for c in ("shard", "id", "custom_id") if c in names]
    cols += [c for c in QUESTION_COLUMNS if c in names][:1]
    cols += [c for c in ("completion", *SCORE_COLUMNS) if c in names]
    if "error" in names and any(r.get("error") for r in rows):
        cols.append("error")
    return cols


def cell_text(value: Any) -> str:
    """A value as text: a chat conversation as its last user message, None as empty."""
    if value is None:
        return ""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        users = [m for m in value if m.get("role") == "user"] or value
        return str(users[-1]["content"])
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: list[dict[str, Any]], columns: list[str], width: int) -> str:
    """A plain-text table: a header, a rule, then each row with its cells wrapped to the column widths."""
    texts = [[cell_text(r.get(c)) for c in columns] for r in rows]
    gaps = 3 * (len(columns) - 1)
    natural = [max([len(c)] + [max((len(line) for line in t[i].splitlines()), default=0) for t in texts])
               for i, c in enumerate(columns)]
    widths = _fit(natural, [len(c) for c in columns], max(width - gaps, 10 * len(columns)))
    out = [" | ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(),
           "-+-".join("-" * w for w in widths)]
    for t in texts:
        cells = [_wrap(text, w) for text, w in zip(t, widths)]
        for k in range(max(len(c) for c in cells)):
            out.append(" | ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(out)


def _fit(natural: list[int], minimum: list[int], total: int) -> list[int]:
    """Column widths within `total`: narrow columns keep their natural width, wide ones share the rest
    equally (filled from the narrowest up); no column is narrower than its header."""
    widths = [0] * len(natural)
    left = total
    order = sorted(range(len(natural)), key=lambda i: natural[i])
    for k, i in enumerate(order):
        widths[i] = max(min(natural[i], left // (len(order) - k)), minimum[i])
        left -= widths[i]
    return widths


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        lines += textwrap.wrap(paragraph, width, break_long_words=True, replace_whitespace=False) or [""]
    while len(lines) > 1 and not lines[-1]:
        lines.pop()
    return lines


def show(output: str | Path, n: int = 5, columns: list[str] | None = None, width: int | None = None) -> str:
    """The first `n` rows of OUTPUT as a table (see the module docstring)."""
    output = Path(output)
    names, rows = read_rows(output, n, columns)
    cols = columns or default_columns(names, rows)
    width = width or shutil.get_terminal_size((120, 24)).columns
    if not rows:
        return f"{output}: no rows"
    return format_table(rows, cols, width)
