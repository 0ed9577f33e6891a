"""`_manifest.json` (each committed part's range, size and checksum) and `inspect_parts`, the parts' check against it.

A commit writes the part's bytes under a temporary name, then the manifest entry, then renames: an entry without
its part is a commit that did not happen (ignored, dropped at the next save). A part rewritten in place keeps its
old entry as `previous` until the rename is done, so either file is sound. docs/durability.md: "What a rerun checks".
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchrun.output.files import SinkError, write_json_atomic
from batchrun.output.parts import (
    PartInfo,
    PartUnreadable,
    checksum_file,
    part_files,
    part_index,
    part_name,
    read_info,
)

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
VERSION = 1


@dataclass
class Entry:
    start: int
    end: int
    rows: int
    bytes: int
    xxh3: str
    previous: Entry | None = None  # a rewrite in progress: the file may still be this one

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.previous is None:
            del d["previous"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        prev = d.get("previous")
        return cls(start=int(d["start"]), end=int(d["end"]), rows=int(d["rows"]), bytes=int(d["bytes"]),
                   xxh3=str(d["xxh3"]), previous=cls.from_dict(prev) if prev else None)

    def candidates(self) -> list[Entry]:
        return [self] if self.previous is None else [self, self.previous]


@dataclass
class Manifest:
    entries: dict[int, Entry] = field(default_factory=dict)  # part index -> entry

    @classmethod
    def load(cls, out_dir: Path) -> tuple[Manifest | None, str | None]:
        """(manifest, None), (None, None) when there is none, (None, why) when it cannot be read."""
        path = Path(out_dir) / MANIFEST
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            entries = {part_index(Path(name)): Entry.from_dict(e) for name, e in raw["parts"].items()}
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return None, f"{path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return cls(entries), None

    def save(self, out_dir: Path) -> None:
        write_json_atomic(Path(out_dir) / MANIFEST, {
            "version": VERSION, "checksum": "xxh3_64",
            "parts": {part_name(i): e.to_dict() for i, e in sorted(self.entries.items())}})


@dataclass
class PartState:
    index: int
    path: Path
    start: int | None = None  # input range: from the footer, else the entry, else the neighbours
    end: int | None = None
    info: PartInfo | None = None  # the footer, when readable
    entry: Entry | None = None  # the manifest entry the file matches (None: none recorded)
    damage: str | None = None  # why the part cannot be trusted


@dataclass
class Inspection:
    parts: list[PartState]
    manifest: Manifest | None
    manifest_problem: str | None = None

    @property
    def damaged(self) -> list[PartState]:
        return [p for p in self.parts if p.damage]

    def trailing_damaged(self) -> list[PartState]:
        """The damaged parts after the last sound one: dropping them is a plain resume."""
        out: list[PartState] = []
        for p in reversed(self.parts):
            if not p.damage:
                break
            out.append(p)
        return out[::-1]

    def unrecorded(self) -> list[PartState]:
        return [p for p in self.parts if not p.damage and p.entry is None]


def inspect_parts(out_dir: Path, *, checksums: str = "last", fp_hash: str | None = None,
                  accepted: frozenset[str] = frozenset()) -> Inspection:
    """Every part of `out_dir` against its footer and the manifest; checksums: "last" | "all" | "none". SinkError for
    a part of another job (fp_hash, or an `accepted` earlier one: parts --retry-errors kept) or for sound parts
    whose ranges disagree."""
    out_dir = Path(out_dir)
    files = {part_index(p): p for p in part_files(out_dir)}
    manifest, problem = Manifest.load(out_dir)
    entries = manifest.entries if manifest is not None else {}
    count = max(files) + 1 if files else 0
    parts = []
    for i in range(count):
        state = PartState(i, out_dir / part_name(i), entry=entries.get(i))
        if state.entry is not None:
            state.start, state.end = state.entry.start, state.entry.end
        if i not in files:
            state.damage = "missing"
        else:
            _check_file(state, hash_it=checksums == "all" or (checksums == "last" and i == count - 1))
        if state.info is not None and fp_hash is not None and state.info.fingerprint not in {fp_hash, *accepted}:
            raise SinkError(f"{state.path} was written by a different job")
        parts.append(state)
    _fill_ranges(parts)
    _check_contiguous(out_dir, parts)
    return Inspection(parts, manifest, problem)


def _check_file(state: PartState, *, hash_it: bool) -> None:
    try:
        info, num_rows = read_info(state.path)
    except PartUnreadable as e:
        state.damage = f"unreadable ({e})"
        return
    state.info = info
    if num_rows != info.rows:
        state.damage = f"holds {num_rows} rows where its footer says {info.rows}"
        return
    entry, state.entry = state.entry, None
    state.start, state.end = info.start, info.end
    if entry is None:
        return  # written before manifests were kept (or the manifest was lost): the footer is all there is
    size = state.path.stat().st_size
    same = [e for e in entry.candidates() if e.bytes == size and (e.start, e.end, e.rows) ==
            (info.start, info.end, info.rows)]
    if not same:
        state.damage = (f"{size} bytes covering rows {info.start}..{info.end}, where the manifest records "
                        f"{entry.bytes} bytes covering rows {entry.start}..{entry.end}")
        return
    if hash_it or len(same) > 1:
        digest = checksum_file(state.path)
        same = [e for e in same if e.xxh3 == digest]
        if not same:
            state.damage = f"its checksum {digest} is not the one recorded ({entry.xxh3})"
            return
    state.entry = same[0]


def _fill_ranges(parts: list[PartState]) -> None:
    """A damaged part without an entry covers the gap between its neighbours (when they say)."""
    for i, p in enumerate(parts):
        if p.start is None and (i == 0 or parts[i - 1].end is not None):
            p.start = 0 if i == 0 else parts[i - 1].end
        if p.end is None:
            p.end = next((q.start for q in parts[i + 1:] if q.start is not None), None)


def _check_contiguous(out_dir: Path, parts: list[PartState]) -> None:
    expected = 0
    for p in parts:
        if p.start is None or p.end is None:
            continue  # only a trailing damaged part: it is dropped
        if p.start != expected or p.end < p.start:
            raise SinkError(f"{p.path}: the parts in {out_dir} are not contiguous (part {p.index} covers rows "
                            f"{p.start}..{p.end}, expected it to start at {expected}); rerun with --no-resume")
        expected = p.end
