"""ParquetSink: ordered, atomic Parquet parts of `rows_per_part` rows, committed in manifest.py's order; a rerun
continues at the last part's end. On open a damaged last part is dropped, one in the middle is rewritten in place
once its rows are back (`replace_part`, which `--retry-errors` uses too)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.io.rows import RowTask
from batchrun.output.files import (
    SinkError,
    WriteFailure,
    remove_file,
    remove_quietly,
    rename_into_place,
    write_bytes_atomic,
    write_json_atomic,
    write_unrenamed,
)
from batchrun.output.folder import AHEAD, METRICS, TMP_RE
from batchrun.output.manifest import MANIFEST, Entry, Inspection, Manifest, PartState, inspect_parts
from batchrun.output.parts import META_KEY, PartInfo, checksum_file, encode, part_name
from batchrun.output.sink import Counts, OutputSpec, Sink, StoredRow, row_counts
from batchrun.pooling import cosine, softmax

log = logging.getLogger(__name__)


NO_SCORE = "the engine returned no log-probability for a continuation token"


def output_records(task: RowTask, outputs: list[Any] | None, spec: OutputSpec) -> list[dict[str, Any]]:
    """One record per sample (one for an error row), with the output columns; one per row for a loglikelihood job."""
    base: dict[str, Any] = {"id": task.id}
    for c in spec.keep_columns:
        base[c] = task.keep.get(c)
    if spec.include_prompt:
        base["prompt"] = task.prompt
    if spec.truncated_tokens:
        base["truncated_tokens"] = task.truncated or (0 if outputs is not None else None)
    if spec.task == "loglikelihood":
        return [_scored_record(task, outputs, spec, base)]
    if spec.task in POOLED_COLUMNS:
        return [_pooled_record(task, outputs, spec, base)]
    if outputs is None:
        reason = "skipped" if task.skipped else "error"
        rec = {**base, "completion": None, "finish_reason": reason, "prompt_tokens": task.prompt_tokens,
               "completion_tokens": 0, "error": task.error}
        if spec.sample_index:
            rec["sample_index"] = 0
        return [rec]
    recs = []
    prompt_logprobs = None
    if spec.prompt_logprobs and task.prompt_logprobs is not None:
        prompt_logprobs = [None if d is None else [(t, float(lp)) for t, lp in d.items()] for d in task.prompt_logprobs]
    for j, out in enumerate(outputs):
        # a structured output cut off before its grammar completed keeps its text, with the error beside it
        rec = {**base, "completion": out.text, "finish_reason": out.finish_reason or "length",
               "prompt_tokens": task.prompt_tokens, "completion_tokens": len(out.token_ids),
               "error": getattr(out, "error", None)}
        if spec.sample_index:
            rec["sample_index"] = out.index if out.index is not None else j
        if spec.include_token_ids:
            rec["token_ids"] = list(out.token_ids)
        if spec.logprobs:
            rec["logprobs"] = [[(t, float(lp)) for t, lp in d.items()] for d in out.logprobs] \
                if out.logprobs is not None else None
        if spec.prompt_logprobs:
            rec["prompt_logprobs"] = prompt_logprobs
        recs.append(rec)
    return recs


def _scored_record(task: RowTask, outputs: list[Any] | None, spec: OutputSpec, base: dict[str, Any]) -> dict[str, Any]:
    """A loglikelihood row: the continuation's summed log-probability (float64), whether it is the greedy one, its
    token count; null scores for a row that did not run (an error, or skipped)."""
    n = task.continuation_tokens
    rec = {**base, "logprob": None, "is_greedy": None, "num_tokens": n, "prompt_tokens": task.prompt_tokens,
           "error": task.error}
    if spec.include_token_ids:
        rec["token_ids"] = list(task.prompt_ids[-n:]) if n and task.prompt_ids is not None else None
    if outputs is not None and task.error is None:
        score = task.score()
        if score is None:
            rec["error"] = NO_SCORE
        else:
            rec["logprob"], rec["is_greedy"] = score
    return rec


# each pooling task's answer columns (the first one is null exactly when the row did not run)
POOLED_COLUMNS = {"embed": ("embedding",), "classify": ("logits", "probs", "label"), "score": ("score",)}


def _pooled_record(task: RowTask, outputs: list[Any] | None, spec: OutputSpec, base: dict[str, Any]
                   ) -> dict[str, Any]:
    """A pooling row: its embedding, its classes (logits, softmax probabilities, the likeliest label's name) or its
    score; nulls for a row that did not run."""
    rec = {**base, **dict.fromkeys(POOLED_COLUMNS[spec.task]), "prompt_tokens": task.prompt_tokens,
           "error": task.error}
    vector = task.pooled[0] if outputs is not None and task.error is None and task.pooled else None
    if vector is None:
        return rec
    if spec.task == "embed":
        rec["embedding"] = vector
    elif spec.task == "score":
        rec["score"] = cosine(vector, task.pooled[1]) if len(task.pooled) > 1 else vector[0]
    else:
        best = max(range(len(vector)), key=vector.__getitem__)
        rec["logits"], rec["probs"] = vector, softmax(vector)
        rec["label"] = spec.labels[best] if best < len(spec.labels) else str(best)
    return rec


def ran(table: pa.Table) -> list[bool]:
    """Which rows of an output's table ran on the engine (their prompt tokens are counted): not an error or skipped
    row (finish_reason), or for a loglikelihood output, a row with a score or an error after it ran."""
    if "finish_reason" in table.column_names:
        return [r not in ("error", "skipped") for r in table.column("finish_reason").to_pylist()]
    pooled = next((c[0] for c in POOLED_COLUMNS.values() if c[0] in table.column_names), None)
    if pooled is not None:
        return [v is not None for v in table.column(pooled).to_pylist()]
    return [lp is not None or e == NO_SCORE for lp, e in zip(table.column("logprob").to_pylist(),
                                                             table.column("error").to_pylist())]


class ParquetSink(Sink):
    def __init__(self, out_dir: Path, spec: OutputSpec, rows_per_part: int, fp_hash: str) -> None:
        super().__init__(out_dir, spec, rows_per_part, fp_hash)
        self.columns: dict[str, list[Any]] = {}
        self.errors_at: list[list[int]] = []  # of the pending rows: [position, first row, rows]
        self.schema: pa.Schema | None = None
        self.next_part = 0
        self.manifest = Manifest()
        self.parts: dict[int, PartInfo] = {}  # the footers of the sound committed parts
        self.inspection: Inspection | None = None

    def column_names(self) -> list[str]:
        s = self.spec
        names = ["id", *[c for c in s.keep_columns if c != "id"]]
        if s.include_prompt:
            names.append("prompt")
        if s.truncated_tokens:
            names.append("truncated_tokens")
        if s.task == "loglikelihood":
            return names + ["logprob", "is_greedy", "num_tokens", "prompt_tokens"] + \
                (["token_ids"] if s.include_token_ids else []) + ["error"]
        if s.task in POOLED_COLUMNS:
            return names + [*POOLED_COLUMNS[s.task], "prompt_tokens", "error"]
        if s.sample_index:
            names.append("sample_index")
        names += ["completion", "finish_reason", "prompt_tokens", "completion_tokens"]
        if s.include_token_ids:
            names.append("token_ids")
        if s.logprobs:
            names.append("logprobs")
        if s.prompt_logprobs:
            names.append("prompt_logprobs")
        names.append("error")
        return names

    def check_columns(self) -> None:
        if self.schema is None:
            return
        added = [c for c in self.column_names() if c not in self.schema.names]
        if added:
            log.warning("--retry-errors: the output has no column %s (written before the job asked for it); the "
                        "retried rows keep the output's columns", ", ".join(added))

    FIXED_TYPES = {
        "prompt": pa.string(), "sample_index": pa.int32(), "completion": pa.string(),
        "finish_reason": pa.string(), "prompt_tokens": pa.int32(), "completion_tokens": pa.int32(),
        "token_ids": pa.list_(pa.int32()), "logprobs": pa.list_(pa.map_(pa.int64(), pa.float64())),
        "error": pa.string(), "truncated_tokens": pa.int32(),
        "prompt_logprobs": pa.list_(pa.map_(pa.int64(), pa.float64())),
        "logprob": pa.float64(), "is_greedy": pa.bool_(), "num_tokens": pa.int32(),
        "logits": pa.list_(pa.float32()), "probs": pa.list_(pa.float32()), "label": pa.string(),
        "score": pa.float64(),
    }

    # ------------------------------------------------------------ what is committed

    def scan(self) -> Counts:
        """The sound parts' counts, up to the last sound part (damaged parts after it are dropped on open)."""
        self.inspection = insp = inspect_parts(self.out_dir, checksums=self.checksums, fp_hash=self.fp_hash,
                                               accepted=self.accepted)
        counts = Counts()
        for p in insp.parts:
            if not p.damage:
                counts.add(Counts.of(p.info))
        return counts

    def open(self) -> Counts:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for p in self.out_dir.iterdir():
            if TMP_RE.match(p.name):
                remove_quietly(p)
        self.committed = self.scan()
        insp = self.inspection
        if insp.manifest_problem:
            log.warning("%s; it is written again from the parts as they are", insp.manifest_problem)
        dropped = insp.trailing_damaged()
        for p in dropped:
            log.warning("%s is damaged (%s): its rows %s..%s are computed again", p.path, p.damage, p.start,
                        "the end" if p.end is None else p.end)
            remove_quietly(p.path)
        kept = insp.parts[:len(insp.parts) - len(dropped)]
        self.repairs = [p for p in kept if p.damage]
        for p in self.repairs:
            log.warning("%s is damaged (%s): its rows %d..%d are computed again and the part rewritten in place",
                        p.path, p.damage, p.start, p.end)
        self.manifest = insp.manifest or Manifest()
        self._record_parts(kept)
        self.parts = {p.index: p.info for p in kept if not p.damage}
        self.next_part = len(kept)
        sound = [p for p in kept if not p.damage]
        if sound:
            self.schema = pq.read_schema(sound[0].path).remove_metadata()
        self.pending = Counts(end=self.committed.end)
        self.columns = {n: [] for n in self.column_names()}
        self.errors_at = []
        return self.committed

    def _record_parts(self, kept: list[PartState]) -> None:
        """The manifest as the parts are now: entries of parts never renamed into place dropped, finished rewrites
        settled, parts without an entry (an older batchrun's, a lost manifest) recorded as they are."""
        before = {i: e.to_dict() for i, e in self.manifest.entries.items()}
        entries = {i: e for i, e in self.manifest.entries.items() if i < len(kept)}
        unrecorded = 0
        for p in kept:
            if p.damage:
                continue
            if p.entry is None:
                unrecorded += 1
                p.entry = Entry(p.info.start, p.info.end, p.info.rows, p.path.stat().st_size, checksum_file(p.path))
            entries[p.index] = Entry(p.entry.start, p.entry.end, p.entry.rows, p.entry.bytes, p.entry.xxh3)
        if unrecorded:
            log.info("recorded the size and checksum of %d parts in %s that had none", unrecorded, MANIFEST)
        self.manifest.entries = entries
        if {i: e.to_dict() for i, e in entries.items()} != before:
            self.manifest.save(self.out_dir)

    # ------------------------------------------------------------ appending

    def _payload(self, task: RowTask, outputs: list[Any] | None) -> list[Any]:
        return output_records(task, outputs, self.spec)

    def _add_payload(self, row: StoredRow) -> None:
        records = row.payload
        if row.counts.errors:
            self.errors_at.append([row.pos, self.pending.rows, len(records)])
        for rec in records:
            for name, values in self.columns.items():
                values.append(rec.get(name))
        self.pending.rows += len(records)

    def save_ahead(self, rows: list[StoredRow]) -> None:
        path = self.out_dir / AHEAD
        if not rows:
            remove_file(path)
            return
        columns = {n: [rec.get(n) for r in rows for rec in r.payload] for n in self.column_names()}
        schema = self.schema or pa.schema([pa.field(n, self._type_of(n, v)) for n, v in columns.items()])
        table = pa.Table.from_arrays([self._array(f.name, columns.get(f.name, []), f.type) for f in schema],
                                     schema=schema)
        meta = {"fingerprint": self.fp_hash, "rows": [
            [r.pos, r.index, r.id_text, r.error, r.counts.errors, r.counts.prompt_tokens,
             r.counts.completion_tokens, len(r.payload)] for r in rows]}
        table = table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})
        stream = pa.BufferOutputStream()
        pq.write_table(table, stream)
        write_bytes_atomic(path, stream.getvalue())

    def load_ahead(self) -> list[StoredRow]:
        path = self.out_dir / AHEAD
        if not path.exists():
            return []
        try:
            table = pq.read_table(path)
            meta = json.loads(table.schema.metadata[META_KEY])
        except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as e:
            log.warning("%s is unreadable (%s): the rows it kept are computed again", path, str(e).splitlines()[0])
            return []
        if meta.get("fingerprint") not in {self.fp_hash, *self.accepted}:
            return []
        records = table.replace_schema_metadata(None).to_pylist()
        rows, at = [], 0
        for pos, index, id_text, error, errors, prompt, completion, n in meta["rows"]:
            if pos >= self.committed.end:
                rows.append(StoredRow(pos, index, id_text, error, Counts(errors=errors, prompt_tokens=prompt,
                                      completion_tokens=completion, inputs=1), records[at:at + n]))
            at += n
        return rows

    def commit(self) -> None:
        if self.pending.end == self.committed.end:
            return
        table = self._table(self.columns)
        info = PartInfo(start=self.committed.end, end=self.pending.end, rows=self.pending.rows,
                        errors=self.pending.errors, prompt_tokens=self.pending.prompt_tokens,
                        completion_tokens=self.pending.completion_tokens, fingerprint=self.fp_hash,
                        errors_at=self.errors_at)
        self._write_part(self.next_part, table, info)
        log.debug("committed %s: input rows %d..%d, %d output rows", part_name(self.next_part), info.start,
                  info.end, info.rows)
        self.parts[self.next_part] = info
        self.next_part += 1
        self._committed_pending()
        self.columns = {n: [] for n in self.column_names()}
        self.errors_at = []

    def _write_part(self, index: int, table: pa.Table, info: PartInfo, *, rewrite: bool = False,
                    replacing: Entry | None = None) -> None:
        """Bytes under a temporary name, the manifest entry, the rename (batchrun.output.manifest's order).
        rewrite: the part exists (replacing: its entry, while the file may still be the old one)."""
        data, digest = encode(table, info)
        path = self.out_dir / part_name(index)
        tmp = write_unrenamed(path, data)
        old = self.manifest.entries.get(index)
        if not rewrite:  # entries after a new last part are of commits that never happened
            self.manifest.entries = {i: e for i, e in self.manifest.entries.items() if i < index}
        self.manifest.entries[index] = Entry(info.start, info.end, info.rows, len(data), digest, previous=replacing)
        try:
            self.manifest.save(self.out_dir)
        except WriteFailure:
            remove_quietly(tmp)
            if old is not None:
                self.manifest.entries[index] = old
            raise
        rename_into_place(tmp, path)
        self.manifest.entries[index].previous = None  # settled; written with the next save

    # ------------------------------------------------------------ rewriting a committed part

    def part_range(self, index: int) -> tuple[int, int]:
        info = self.parts.get(index)
        if info is not None:
            return info.start, info.end
        state = next(p for p in self.repairs if p.index == index)
        return state.start, state.end

    def error_rows(self) -> dict[int, list[int]]:
        """Part index -> the positions of its error rows that are written (for --retry-errors)."""
        return {i: [e[0] for e in info.errors_at] for i, info in sorted(self.parts.items()) if info.errors_at}

    def replace_part(self, index: int, rows: dict[int, tuple[RowTask, list[Any] | None, bool]]) -> None:
        """Rewrite part `index` in place with rows computed again, (task, outputs, write) by position: every position
        of a damaged part; some error rows of a sound one (--retry-errors), every other row kept as it is."""
        info = self.parts.get(index)
        if info is None:
            table, new = self._rebuild(index, rows)
            replacing = None  # the file is damaged: nothing of it is worth keeping
        else:
            table, new = self._patch(index, info, rows)
            replacing = self.manifest.entries.get(index)
        self._write_part(index, table, new, rewrite=True, replacing=replacing)
        if info is not None:
            self.committed.remove(Counts.of(info))
        else:
            self.repairs = [p for p in self.repairs if p.index != index]
        self.committed.add(Counts.of(new))
        self.this_run.add(Counts(rows=new.rows, inputs=len(rows), errors=sum(
            row_counts(t, o).errors for t, o, _ in rows.values())))
        self.parts[index] = new
        self._refresh_metrics()

    def _refresh_metrics(self) -> None:
        """_metrics.json's counts after a part changed in place (true of the parts if the run stops now)."""
        path = self.out_dir / METRICS
        try:
            metrics = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # none yet: the run writes it at its end
        write_json_atomic(path, {**metrics, **self.committed.as_dict()})

    def _rebuild(self, index: int, rows: dict[int, tuple[RowTask, list[Any] | None, bool]]) -> tuple[pa.Table, PartInfo]:
        start, end = self.part_range(index)
        missing = [p for p in range(start, end) if p not in rows]
        if missing:
            raise RuntimeError(f"internal error: part {index} rebuilt without positions {missing[:5]}")
        columns: dict[str, list[Any]] = {n: [] for n in self.column_names()}
        counts, errors_at = Counts(end=end), []
        for pos in range(start, end):
            task, outputs, write = rows[pos]
            counts.add(row_counts(task, outputs))
            if not write:
                continue
            records = output_records(task, outputs, self.spec)
            if row_counts(task, outputs).errors:
                errors_at.append([pos, counts.rows, len(records)])
            for rec in records:
                for name, values in columns.items():
                    values.append(rec.get(name))
            counts.rows += len(records)
        return self._table(columns), PartInfo(start, end, counts.rows, counts.errors, counts.prompt_tokens,
                                              counts.completion_tokens, self.fp_hash, errors_at)

    def _patch(self, index: int, info: PartInfo, rows: dict[int, tuple[RowTask, list[Any] | None, bool]]
               ) -> tuple[pa.Table, PartInfo]:
        old = pq.read_table(self.out_dir / part_name(index)).replace_schema_metadata(None)
        if self.schema is not None and not old.schema.equals(self.schema):
            old = old.cast(self.schema)
        ids = old.column("id").to_pylist()
        ran_rows, prompt = ran(old), old.column("prompt_tokens").to_pylist()
        completion = old.column("completion_tokens").to_pylist() if "completion_tokens" in old.column_names \
            else [0] * old.num_rows
        # old rows from `cursor` on are copied as they are: old row x lands at rows_out + (x - cursor)
        pieces, errors_at, cursor, rows_out = [], [], 0, 0
        counts = Counts.of(info)
        for pos, first, n in info.errors_at:
            if pos not in rows:
                errors_at.append([pos, rows_out + first - cursor, n])
                continue
            task, outputs, write = rows[pos]
            if task.id != ids[first]:
                raise SinkError(f"--retry-errors: input row {task.index} has id {task.id!r} where "
                                f"{self.out_dir / part_name(index)} has {ids[first]!r}; the input changed "
                                "since the output was written (rerun with --no-resume)")
            pieces.append(old.slice(cursor, first - cursor))
            rows_out += first - cursor
            counts.remove(Counts(rows=n, errors=1, prompt_tokens=(prompt[first] or 0) if ran_rows[first] else 0,
                                 completion_tokens=sum(c or 0 for c in completion[first:first + n])))
            counts.add(row_counts(task, outputs))
            if write:
                records = output_records(task, outputs, self.spec)
                if row_counts(task, outputs).errors:
                    errors_at.append([pos, rows_out, len(records)])
                pieces.append(self._table({name: [r.get(name) for r in records] for name in self.column_names()}))
                rows_out += len(records)
                counts.rows += len(records)
            cursor = first + n
        pieces.append(old.slice(cursor))
        table = pa.concat_tables(pieces)
        return table, PartInfo(info.start, info.end, table.num_rows, counts.errors, counts.prompt_tokens,
                               counts.completion_tokens, info.fingerprint, errors_at)

    # ------------------------------------------------------------ arrays

    def _type_of(self, name: str, values: list[Any]) -> pa.DataType:
        if name == "embedding" and self.spec.task == "embed":  # fixed-size once a row has one
            value_type = pa.float16() if self.spec.embedding_dtype == "float16" else pa.float32()
            size = next((len(v) for v in values if v is not None), None)
            return pa.list_(value_type) if size is None else pa.list_(value_type, size)
        if name in self.FIXED_TYPES:
            return self.FIXED_TYPES[name]
        known = self.spec.id_type if name == "id" else self.spec.known_types.get(name)
        if known is not None:
            return known
        inferred = pa.array(values).type
        return pa.string() if pa.types.is_null(inferred) else inferred

    def _array(self, name: str, values: list[Any], typ: pa.DataType) -> pa.Array:
        try:
            return pa.array(values, type=typ)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            if pa.types.is_string(typ) or pa.types.is_large_string(typ):
                return pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str)
                                 for v in values], type=typ)
            raise SinkError(f"output column {name!r}: a value does not fit the column type {typ} "
                            f"(taken from the earlier rows): {str(e).splitlines()[0]}") from None

    def _table(self, columns: dict[str, list[Any]]) -> pa.Table:
        """Columns of python values as a table of the output's schema (fixed by the first part written)."""
        if self.schema is None:
            self.schema = pa.schema([pa.field(n, self._type_of(n, columns[n])) for n in self.column_names()])
        n = len(next(iter(columns.values()), []))
        arrays = [self._array(f.name, columns.get(f.name, [None] * n), f.type) for f in self.schema]
        return pa.Table.from_arrays(arrays, schema=self.schema)
