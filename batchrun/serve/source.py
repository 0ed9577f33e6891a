"""The OpenAI batch reader, with each line that failed batchrun.serve.checks replaced by a row error saying
why. It reads bytes and counts non-blank lines as the checks do, so each problem lands on its own line
whatever the file holds; and it opens nothing at construction (the plain reader refuses a first line that
is not JSON)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchrun.io.base import Row, Source
from batchrun.io.sources import BATCH_BYTES, ROW_ERROR, InputReadError, OpenAIBatchSource
from batchrun.serve.checks import Checked


class CheckedBatchSource(OpenAIBatchSource):
    def __init__(self, path: Path, checked: Checked) -> None:
        Source.__init__(self, str(path))
        self.files = [str(path)]
        self.columns = list(self.COLUMNS)
        self.checked = checked

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "requests": self.checked.requests}

    def num_rows(self) -> int:
        return self.checked.requests

    def count_rows(self) -> int:
        return self.checked.requests

    def iter_rows(self, start: int = 0, columns: list[str] | None = None,
                  batch_size: int = 1024) -> Iterator[list[Row]]:
        problems = self.checked.problems
        name = os.path.basename(self.path)
        batch: list[Row] = []
        index = nbytes = 0
        try:
            with open(self.path, "rb") as f:
                for number, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    index += 1
                    if index <= start:
                        continue
                    problem = problems.get(index - 1)
                    if problem is not None:
                        batch.append({ROW_ERROR: problem.message, "custom_id": problem.custom_id})
                    else:  # checked: JSON, UTF-8, an object with a body
                        batch.append(self._parse(raw.decode("utf-8"), f"{name} line {number}"))
                    nbytes += len(raw)
                    if len(batch) >= batch_size or nbytes >= BATCH_BYTES:
                        yield batch
                        batch, nbytes = [], 0
        except OSError as e:
            raise InputReadError(f"reading {self.path}: {e.strerror or e}") from e
        if batch:
            yield batch

