"""Committed Parquet parts: names, footers, bytes and xxh3-64 checksums (why xxh3: docs/durability.md).

A footer (key-value metadata ``batchrun``) holds the input positions covered, the counts, the job fingerprint and
`errors_at` (for --retry-errors, without reading every row); the footers are the resume state."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
META_KEY = b"batchrun"
CHUNK = 8 << 20


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def part_index(path: Path) -> int:
    return int(PART_RE.match(Path(path).name).group(1))


def part_files(out_dir: Path) -> list[Path]:
    if not Path(out_dir).is_dir():
        return []
    parts = [p for p in Path(out_dir).iterdir() if PART_RE.match(p.name)]
    return sorted(parts, key=part_index)


@dataclass
class PartInfo:
    """What a part's footer says about it."""

    start: int  # first input position covered
    end: int  # one past the last
    rows: int  # output rows in the part
    errors: int = 0  # input rows with an error (written or skipped)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    fingerprint: str = ""
    errors_at: list[list[int]] = field(default_factory=list)  # [position, first row, rows] per error row written

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PartInfo:
        d: dict[str, Any] = json.loads(raw)
        return cls(start=int(d["start"]), end=int(d["end"]), rows=int(d["rows"]), errors=int(d["errors"]),
                   prompt_tokens=int(d["prompt_tokens"]), completion_tokens=int(d["completion_tokens"]),
                   fingerprint=str(d.get("fingerprint", "")), errors_at=[list(map(int, e)) for e in
                                                                         d.get("errors_at", [])])


class PartUnreadable(Exception):
    """A part's footer cannot be read (truncated, overwritten, not Parquet)."""


def read_info(path: Path) -> tuple[PartInfo, int]:
    """The footer of a part and the row count Parquet itself records; PartUnreadable when there is none."""
    try:
        meta = pq.read_metadata(path)
        raw = (meta.metadata or {})[META_KEY]
        return PartInfo.from_json(raw), meta.num_rows
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as e:
        raise PartUnreadable(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


def encode(table: pa.Table, info: PartInfo) -> tuple[pa.Buffer, str]:
    """A part's file in memory, with its footer, and its checksum (hashed without reading the file back)."""
    table = table.replace_schema_metadata({META_KEY: info.to_json()})
    stream = pa.BufferOutputStream()
    pq.write_table(table, stream)
    data = stream.getvalue()
    return data, checksum_bytes(data)


def checksum_bytes(data: Any) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data))


def checksum_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()
