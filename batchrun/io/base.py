"""The Source contract and its helpers, apart so that sources.py and hf_datasets.py import it, not each other."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

Row = dict[str, Any]


class Source(ABC):
    """A table of input rows. Subclasses fill `columns` (None when unknown) and implement iter_rows."""

    format = "?"

    def __init__(self, path: str) -> None:
        self.path = path
        self.columns: list[str] | None = None

    def arrow_types(self) -> dict[str, pa.DataType]:
        """Arrow types of the columns, where the input declares them (Parquet, datasets)."""
        return {}

    def num_rows(self) -> int | None:
        """The row count when it is cheap to know (metadata), else None."""
        return None

    def count_rows(self) -> int | None:
        """The row count, scanning the input if need be; None if it cannot be known (a remote stream)."""
        return self.num_rows()

    @abstractmethod
    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        """Batches of rows from position `start`, reading only `columns` where the format allows."""

    def identity(self) -> dict[str, Any]:
        """What identifies this input for resume checks: format, path, and total size of its files."""
        return {"format": self.format, "path": self.path}

    def has_column(self, name: str) -> bool:
        return self.columns is None or name in self.columns


def size_of(paths: list[str]) -> int:
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
