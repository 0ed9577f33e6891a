"""`batchrun verify OUTPUT`: the full check of an output folder (docs/durability.md), one line per problem.
Job-array shards are checked one by one; OpenAI batch output against `_progress.json` (length, lines, count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.config import JobError
from batchrun.io.sources import open_source
from batchrun.output.files import SinkError
from batchrun.output.folder import (
    AHEAD,
    AHEAD_JSONL,
    METRICS,
    OPENAI_OUTPUT,
    PROGRESS,
    SHARD_RE,
    SUCCESS,
    read_job_file,
)
from batchrun.output.lock import in_use
from batchrun.output.manifest import inspect_parts
from batchrun.output.parts import part_files


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why
    parts: int = 0
    rows: int = 0
    positions: int = 0


def verify(output: str | Path) -> Report:
    output = Path(output)
    if not output.is_dir():
        raise JobError(f"{output} is not a folder")
    report = Report()
    shards = sorted((int(m.group(2)), int(m.group(1)), p) for p in output.iterdir()
                    if p.is_dir() and (m := SHARD_RE.match(p.name)))
    if _is_output(output):
        _verify_folder(output, report)
    elif shards:
        arrays: dict[int, set[int]] = {}
        for count, index, folder in shards:
            arrays.setdefault(count, set()).add(index)
            _verify_folder(folder, report)
        for count, indices in sorted(arrays.items()):
            missing = sorted(set(range(count)) - indices)
            if missing:
                report.problems.append(f"{output}: the array of {count} shards lacks shard(s) "
                                       f"{', '.join(map(str, missing[:10]))}")
    else:
        raise JobError(f"{output} holds no batchrun output (no parts, no shard folders)")
    return report


def _is_output(folder: Path) -> bool:
    return bool(part_files(folder)) or any((folder / name).exists() for name in
                                           (SUCCESS, METRICS, OPENAI_OUTPUT, "_job.json"))


def _verify_folder(folder: Path, report: Report) -> None:
    holder = in_use(folder)
    if holder is not None:
        report.problems.append(f"{folder}: in use by a running batchrun ({holder}); verify it once that ends")
        return
    if (folder / OPENAI_OUTPUT).exists():
        _verify_openai(folder, report)
    else:
        _verify_parts(folder, report)
    if not (folder / SUCCESS).exists():
        report.problems.append(f"{folder}: not complete (no {SUCCESS}); a rerun of the job finishes it")
    for name in (AHEAD, AHEAD_JSONL):
        if not (folder / name).exists():
            continue
        if (folder / SUCCESS).exists():
            report.problems.append(f"{folder / name}: left in a complete output (rows finished ahead are written "
                                   "into the parts before the output completes)")
        else:
            report.notes.append(f"{folder}: rows finished ahead of an earlier row are kept in {name}; the rerun "
                                "writes them in their place without computing them again")


def _verify_parts(folder: Path, report: Report) -> None:
    problems = report.problems
    job = read_job_file(folder) or {}
    try:
        insp = inspect_parts(folder, checksums="all")
    except SinkError as e:
        problems.append(str(e))
        return
    if insp.manifest_problem:
        problems.append(insp.manifest_problem)
    elif insp.manifest is None and insp.parts:
        problems.append(f"{folder}: no _manifest.json, so no checksum to check the parts against (written by a "
                        "batchrun that kept none; a rerun of the job records them)")
    for p in insp.parts:
        if p.damage:
            problems.append(f"{p.path}: damaged: {p.damage}")
        elif p.entry is None and insp.manifest is not None:
            problems.append(f"{p.path}: not in the manifest")
    accepted = {job.get("fingerprint_hash"), *job.get("earlier_fingerprints", [])} - {None}
    ids: list[Any] = []
    groups: list[int] = []  # output row where each input position's rows start
    totals = {"output_rows": 0, "row_errors": 0, "prompt_tokens": 0, "completion_tokens": 0}
    for p in insp.parts:
        if p.damage:
            continue
        info = p.info
        if accepted and info.fingerprint not in accepted:
            problems.append(f"{p.path}: written by a different job than {folder / '_job.json'} records")
        try:
            table = pq.read_table(p.path)
        except (OSError, pa.ArrowException) as e:
            problems.append(f"{p.path}: cannot be read whole ({str(e).splitlines()[0]})")
            continue
        _check_errors_at(p.path, table, info, problems)
        totals["output_rows"] += info.rows
        totals["row_errors"] += info.errors
        totals["prompt_tokens"] += info.prompt_tokens
        totals["completion_tokens"] += info.completion_tokens
        part_ids = table.column("id").to_pylist()
        samples = table.column("sample_index").to_pylist() if "sample_index" in table.column_names else None
        for k in range(len(part_ids)):
            if samples is None or samples[k] in (0, None):
                groups.append(len(ids) + k)
        ids += part_ids
        report.parts += 1
    report.rows = len(ids)
    end = insp.parts[-1].end if insp.parts and insp.parts[-1].end is not None else 0
    report.positions = end
    if insp.damaged:  # what follows would only repeat the damage in other words
        report.notes.append(f"{folder}: counts and ids are checked once the damaged parts are computed again "
                            "(a rerun of the job does it)")
        return
    _check_metrics(folder, {**totals, "input_rows": end}, problems)
    _check_ids(folder, job, [ids[g] for g in groups], end, report)
    if (folder / SUCCESS).exists():
        hi, lo = (job.get("slice") or {}).get("hi"), (job.get("slice") or {}).get("lo") or 0
        if hi is not None and not (job.get("slice") or {}).get("strided") and end != hi - lo:
            problems.append(f"{folder}: {SUCCESS} is there but the parts cover input rows 0..{end} of {hi - lo}")


def _check_errors_at(path: Path, table: pa.Table, info: Any, problems: list[str]) -> None:
    errors = table.column("error").to_pylist()
    listed = set()
    for pos, first, n in info.errors_at:
        listed.update(range(first, first + n))
        if first + n > len(errors) or not any(errors[first:first + n]):
            problems.append(f"{path}: its footer places an error row of input position {pos} at row {first}, "
                            "which has no error")
            return
    stray = [k for k, e in enumerate(errors) if e is not None and k not in listed]
    if stray:
        problems.append(f"{path}: row {stray[0]} has an error its footer does not list ({len(stray)} such rows)")


def _check_metrics(folder: Path, totals: dict[str, int], problems: list[str]) -> None:
    try:
        metrics = json.loads((folder / METRICS).read_text())
    except FileNotFoundError:
        if (folder / SUCCESS).exists():
            problems.append(f"{folder / METRICS}: missing")
        return
    except (OSError, ValueError) as e:
        problems.append(f"{folder / METRICS}: unreadable ({e})")
        return
    for key, value in totals.items():
        if key in metrics and metrics[key] != value:
            problems.append(f"{folder / METRICS}: {key} is {metrics[key]}, the parts hold {value}")


def _check_ids(folder: Path, job: dict[str, Any], got: list[Any], end: int, report: Report) -> None:
    """The ids, one per input position that has rows, against the input's in order."""
    expected = _expected_ids(job, end, report)
    if expected is None:
        return
    if len(got) == len(expected):
        wrong = [k for k, (a, b) in enumerate(zip(got, expected)) if a != b]
        if wrong:
            k = wrong[0]
            report.problems.append(f"{folder}: the rows of input position {k} have id {got[k]!r} where the input "
                                   f"has {expected[k]!r} ({len(wrong)} positions differ)")
        return
    if len(got) > len(expected):
        report.problems.append(f"{folder}: {len(got)} input positions have rows, the input has {len(expected)} "
                               "(rows written twice?)")
        return
    skipping = (job.get("input") or {}).get("on_error") == "skip"
    it = iter(expected)
    in_order = all(any(a == b for b in it) for a in got)  # a subsequence: rows of skipped positions absent
    if not in_order:
        report.problems.append(f"{folder}: the ids are not the input's in input order")
    elif not skipping:
        report.problems.append(f"{folder}: {len(expected) - len(got)} input positions have no rows")


def _expected_ids(job: dict[str, Any], end: int, report: Report) -> list[Any] | None:
    sl = job.get("slice") or {}
    lo, strided, index, count = sl.get("lo") or 0, sl.get("strided"), sl.get("index") or 0, sl.get("count") or 1
    indices = [index + k * count for k in range(end)] if strided else list(range(lo, lo + end))
    id_column = job.get("id_column")
    if not id_column:
        if job.get("input") is None:
            report.notes.append("ids not checked: the output does not say how its input was read")
            return None
        return indices if not _openai(job) else None
    try:
        source = open_source(job["input"])
        by_index: dict[int, Any] = {}
        wanted = set(indices)
        last = max(indices) if indices else -1
        i = min(indices) if indices else 0
        for batch in source.iter_rows(i, [id_column]):
            for row in batch:
                if i in wanted:
                    by_index[i] = row.get(id_column)
                i += 1
            if i > last:
                break
        return [by_index.get(k) for k in indices]
    except (JobError, OSError, ValueError, KeyError, TypeError) as e:
        report.notes.append(f"ids not checked against the input ({str(e).splitlines()[0] if str(e) else e})")
        return None


def _openai(job: dict[str, Any]) -> bool:
    return (job.get("input") or {}).get("format") == "openai-batch"


def _verify_openai(folder: Path, report: Report) -> None:
    try:
        progress = json.loads((folder / PROGRESS).read_text())
    except (OSError, ValueError) as e:
        report.problems.append(f"{folder / PROGRESS}: unreadable ({e})")
        return
    data = (folder / OPENAI_OUTPUT).read_bytes()
    if len(data) < progress["bytes"]:
        report.problems.append(f"{folder / OPENAI_OUTPUT}: {len(data)} bytes, {PROGRESS} records {progress['bytes']}")
        return
    lines = data[:progress["bytes"]].decode("utf-8", "replace").splitlines()
    bad = [k for k, line in enumerate(lines) if not _json_ok(line)]
    if bad:
        report.problems.append(f"{folder / OPENAI_OUTPUT}: line {bad[0] + 1} is not JSON ({len(bad)} such lines)")
    if len(lines) != progress["rows"]:
        report.problems.append(f"{folder / OPENAI_OUTPUT}: {len(lines)} lines, {PROGRESS} records {progress['rows']}")
    report.rows, report.positions = len(lines), progress["end"]


def _json_ok(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False
