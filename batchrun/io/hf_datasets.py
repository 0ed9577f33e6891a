"""Hugging Face datasets as sources: a `save_to_disk` folder (memory-mapped) or a streamed `load_dataset`."""

from __future__ import annotations

import glob as globlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchrun.config import JobError
from batchrun.io.base import Row, Source, one_line, size_of

DATASET_BUILDERS = ("json", "parquet", "csv", "text", "arrow")


class DiskDatasetSource(Source):
    """A folder written by Dataset.save_to_disk / DatasetDict.save_to_disk (memory-mapped, so streamed)."""

    format = "dataset"

    def __init__(self, path: str, split: str) -> None:
        super().__init__(path)
        import datasets

        try:
            ds = datasets.load_from_disk(path)
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; all mean "unreadable"
            raise JobError(f"input.path: cannot load the dataset at {path} ({one_line(e)})") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise JobError(f"input.split: {split!r} is not a split of {path} (splits: {', '.join(ds)})")
            ds = ds[split]
        self.split = split
        self.ds = ds.with_format(None)
        self.columns = list(self.ds.column_names)

    def arrow_types(self) -> dict[str, pa.DataType]:
        schema = self.ds.features.arrow_schema
        return {f.name: f.type for f in schema}

    def num_rows(self) -> int:
        return len(self.ds)

    def identity(self) -> dict[str, Any]:
        files = [str(p) for p in Path(self.path).rglob("*") if p.is_file()]
        return {**super().identity(), "split": self.split, "bytes": size_of(files)}

    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        ds = self.ds.select_columns(columns) if columns is not None else self.ds
        for lo in range(start, len(ds), batch_size):
            chunk = ds[lo:lo + batch_size]
            names = list(chunk)
            n = len(chunk[names[0]]) if names else 0
            yield [{c: chunk[c][i] for c in names} for i in range(n)]


class HubDatasetSource(Source):
    """`load_dataset(path, data_files=..., split=...)` streamed: a hub name, or a builder (json, parquet,
    csv, ...) over local data_files."""

    format = "dataset"

    def __init__(self, path: str, split: str, data_files: Any) -> None:
        super().__init__(path)
        self.split, self.data_files = split, data_files
        if path in DATASET_BUILDERS and data_files is None:
            raise JobError(f"input.data_files: the {path!r} builder needs data_files")
        if data_files is not None:
            files = [data_files] if isinstance(data_files, str) else (
                data_files if isinstance(data_files, list) else
                [f for v in data_files.values() for f in ([v] if isinstance(v, str) else v)])
            for f in files:
                if "://" not in f and not globlib.glob(f):
                    raise JobError(f"input.data_files: {f} does not exist")
        self.ds = self._load()
        first = next(iter(self.ds.take(1)), None)
        self.columns = list(first) if first is not None else []

    def _load(self):
        import datasets

        try:
            return datasets.load_dataset(self.path, data_files=self.data_files, split=self.split, streaming=True)
        except Exception as e:  # noqa: BLE001
            raise JobError(f"input.path: cannot load dataset {self.path!r} split {self.split!r} "
                           f"({one_line(e)})") from None

    def num_rows(self) -> int | None:
        try:
            return self.ds.info.splits[self.split].num_examples or None
        except (AttributeError, KeyError, TypeError):
            return None

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "split": self.split, "data_files": self.data_files}

    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        ds = self.ds.skip(start) if start else self.ds
        if columns is not None:
            ds = ds.select_columns(columns)
        for chunk in ds.iter(batch_size=batch_size):
            names = list(chunk)
            n = len(chunk[names[0]]) if names else 0
            yield [{c: chunk[c][i] for c in names} for i in range(n)]
