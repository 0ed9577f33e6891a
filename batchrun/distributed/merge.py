"""`batchrun merge OUTPUT`: a job array's shard folders as one output folder in input order (docs/cluster.md). The
merged parts carry their own footers and manifest (positions in the whole input): `batchrun verify` checks them."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.config import JobError
from batchrun.output.files import SinkError, write_bytes_atomic, write_json_atomic
from batchrun.output.folder import (
    JOB_FILE,
    METRICS,
    OPENAI_OUTPUT,
    PROGRESS,
    SHARD_RE,
    SUCCESS,
    clear_output,
    read_job_file,
)
from batchrun.output.lock import LOCK_FILE, OutputBusy, OutputLock
from batchrun.output.manifest import Entry, Manifest, inspect_parts
from batchrun.output.parquet import ran
from batchrun.output.parts import PartInfo, encode, part_files, part_name, read_info

_COUNTS = ("input_rows", "output_rows", "row_errors", "prompt_tokens", "completion_tokens")


def find_shards(output: Path, count: int | None = None) -> list[Path]:
    """The N shard folders of one array, in order; JobError if one is missing or incomplete."""
    if not output.is_dir():
        raise JobError(f"{output} is not a folder")
    arrays: dict[int, dict[int, Path]] = {}
    for p in output.iterdir():
        m = SHARD_RE.match(p.name)
        if m and p.is_dir():
            arrays.setdefault(int(m.group(2)), {})[int(m.group(1))] = p
    if not arrays:
        raise JobError(f"{output} holds no shard-I-of-N folders (written by batchrun run --shard)")
    if count is None:
        if len(arrays) > 1:
            raise JobError(f"{output} holds shards of arrays of {', '.join(map(str, sorted(arrays)))} tasks; "
                           "choose one with --shards N")
        count = next(iter(arrays))
    shards = arrays.get(count)
    if shards is None:
        raise JobError(f"{output} holds no shards of an array of {count} tasks")
    missing = [i for i in range(count) if i not in shards]
    incomplete = [i for i in range(count) if i in shards and not (shards[i] / SUCCESS).exists()]
    if missing or incomplete:
        what = "; ".join(x for x in (f"missing: {_ids(missing)}" if missing else "",
                                     f"not complete: {_ids(incomplete)}" if incomplete else "") if x)
        raise JobError(f"{output}: shards of {count} {what}; rerun the array (complete shards are skipped)")
    return [shards[i] for i in range(count)]


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")


def _strided(shard: Path) -> bool:
    try:
        info = json.loads((shard / JOB_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool((info.get("slice") or {}).get("strided"))


def _schema(parts: list[Path]) -> pa.Schema:
    schemas = [pq.read_schema(p).remove_metadata() for p in parts]
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise JobError(f"the shards' columns do not agree ({str(e).splitlines()[0]}); set input types "
                       "explicitly (e.g. Parquet input) or read the shards one by one") from None


def merge(output: str | os.PathLike, dest: str | os.PathLike | None = None, count: int | None = None) -> dict[str, Any]:
    """The shards of `output` into `dest` in input order; returns the merged counts. Holds the lock of every
    shard folder (no shard run starts while its parts are read) and of `dest` (no second merge writes it)."""
    output = Path(output)
    dest = Path(dest) if dest is not None else output.with_name(output.name + "-merged")
    if dest.resolve() == output.resolve() or output.resolve() in dest.resolve().parents:
        raise JobError(f"--to {dest}: must be outside {output} (reading {output} would see every row twice)")
    if not output.is_dir():
        raise JobError(f"{output} is not a folder")
    with contextlib.ExitStack() as held:
        try:
            for folder in _array_folders(output, count):  # a shard still running is named first
                held.enter_context(OutputLock(folder, "merge"))
            shards = find_shards(output, count)
            if dest.exists() and any(p.name != LOCK_FILE for p in dest.iterdir()) and not _is_merged(dest):
                raise JobError(f"--to {dest}: exists and is not an earlier merge; choose another folder")
            held.enter_context(OutputLock(dest, "merge"))
        except OutputBusy as e:
            raise JobError(str(e)) from None
        return _merge_locked(output, shards, dest)


def _array_folders(output: Path, count: int | None) -> list[Path]:
    """The shard folders of the array being merged (complete or not: a running one must be seen)."""
    found = [p for p in output.iterdir() if SHARD_RE.match(p.name) and p.is_dir()]
    if count is None:
        counts = {int(SHARD_RE.match(p.name).group(2)) for p in found}
        count = counts.pop() if len(counts) == 1 else None
    return sorted(p for p in found if count is None or int(SHARD_RE.match(p.name).group(2)) == count)


def _merge_locked(output: Path, shards: list[Path], dest: Path) -> dict[str, Any]:
    _check_shards(shards)
    clear_output(dest)
    jobs = [read_job_file(s) or {} for s in shards]
    fingerprint = "merged-" + hashlib.sha256("".join(j.get("fingerprint_hash", "") for j in jobs).encode()
                                             ).hexdigest()[:16]
    manifest = Manifest()
    if (shards[0] / OPENAI_OUTPUT).exists():
        write_bytes_atomic(dest / OPENAI_OUTPUT, _file_chunks([s / OPENAI_OUTPUT for s in shards]))
        progress = [json.loads((s / PROGRESS).read_text()) for s in shards]
        write_json_atomic(dest / PROGRESS, {"end": sum(p["end"] for p in progress), "fingerprint": fingerprint,
                                            "bytes": (dest / OPENAI_OUTPUT).stat().st_size,
                                            **{k: sum(p[k] for p in progress) for k in
                                               ("rows", "errors", "prompt_tokens", "completion_tokens")}})
    elif any(_strided(s) for s in shards):
        _interleave(shards, dest, fingerprint, manifest)
    else:
        parts = [p for s in shards for p in part_files(s)]
        schema = _schema(parts) if parts else None
        for i, p in enumerate(parts):
            lo = int(((read_job_file(p.parent) or {}).get("slice") or {}).get("lo") or 0)
            info = read_info(p)[0]
            info = PartInfo(info.start + lo, info.end + lo, info.rows, info.errors, info.prompt_tokens,
                            info.completion_tokens, fingerprint, [[pos + lo, first, n] for pos, first, n in
                                                                   info.errors_at])
            _write_part(pq.read_table(p).cast(schema), dest, i, info, manifest)
    totals = {k: 0 for k in _COUNTS}
    for s in shards:
        m = json.loads((s / METRICS).read_text())
        for k in _COUNTS:
            totals[k] += int(m.get(k) or 0)
    first = jobs[0]
    write_json_atomic(dest / JOB_FILE, {"fingerprint_hash": fingerprint, "merged_from": str(output),
                                        "input": first.get("input"), "id_column": first.get("id_column"),
                                        "slice": {"lo": 0, "hi": totals["input_rows"], "strided": False,
                                                  "count": 1}})
    write_json_atomic(dest / METRICS, {**totals, "complete": True, "shards": len(shards),
                                       "merged_from": str(output)})
    write_bytes_atomic(dest / SUCCESS, b"")
    return {**totals, "shards": len(shards), "dest": str(dest)}


def _check_shards(shards: list[Path]) -> None:
    """Every part of every shard whole (size, footer, checksum): a merge must not copy a damaged part."""
    for s in shards:
        if (s / OPENAI_OUTPUT).exists():
            continue
        try:
            damaged = inspect_parts(s, checksums="all").damaged
        except SinkError as e:
            raise JobError(f"{s}: {e}") from None
        if damaged:
            p = damaged[0]
            raise JobError(f"{p.path} is damaged ({p.damage}); rerun that shard's task: it computes the part "
                           "again")


def _is_merged(path: Path) -> bool:
    try:
        return "merged_from" in json.loads((path / METRICS).read_text())
    except (OSError, ValueError):
        return False


def _write_part(table: pa.Table, dest: Path, i: int, info: PartInfo, manifest: Manifest) -> None:
    """A merged part, with the footer and manifest entry of any part (positions in the whole input)."""
    data, digest = encode(table, info)
    write_bytes_atomic(dest / part_name(i), data)
    manifest.entries[i] = Entry(info.start, info.end, info.rows, len(data), digest)
    manifest.save(dest)


def _interleave(shards: list[Path], dest: Path, fingerprint: str, manifest: Manifest) -> None:
    """Strided shards (an input of unknown length: shard I holds rows I, I+N, ...) back into row order.
    Only when each input row made exactly one output row; n > 1 or skipped rows leave no way to align."""
    tables = []
    for s in shards:
        parts = part_files(s)
        m = json.loads((s / METRICS).read_text())
        if m.get("output_rows") != m.get("input_rows"):
            raise JobError(f"{s}: strided shards with n > 1 or skipped rows cannot be interleaved; read the "
                           "shards one by one (shard I holds input rows I, I+N, I+2N, ...)")
        tables.append([pq.read_table(p) for p in parts])
    schema = _schema([p for s in shards for p in part_files(s)])
    columns = [pa.concat_tables([t.cast(schema) for t in ts]) if ts else schema.empty_table() for ts in tables]
    n = len(shards)
    total = sum(t.num_rows for t in columns)
    order = [(k % n, k // n) for k in range(total)]
    merged = pa.concat_tables(columns)
    offsets = [sum(t.num_rows for t in columns[:i]) for i in range(n)]
    table = merged.take(pa.array([offsets[s] + r for s, r in order], pa.int64()))
    errors = table.column("error").to_pylist()
    prompt = table.column("prompt_tokens").to_pylist()
    completion = table.column("completion_tokens").to_pylist() if "completion_tokens" in table.column_names else []
    info = PartInfo(0, total, total, errors=sum(e is not None for e in errors),
                    prompt_tokens=sum(p or 0 for p, r in zip(prompt, ran(table)) if r),
                    completion_tokens=sum(c or 0 for c in completion), fingerprint=fingerprint,
                    errors_at=[[k, k, 1] for k, e in enumerate(errors) if e is not None])
    _write_part(table, dest, 0, info, manifest)


def _file_chunks(paths: list[Path]):
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                yield chunk
