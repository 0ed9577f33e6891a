"""sentence-transformers as a benchmark peer for the embedding rows: its own virtualenv, made on first use.

The embedding rows compare every system's vectors with sentence-transformers', so it runs as users run it, in a
process and venv of its own (`$BATCHRUN_CACHE/sentence-transformers-venv`), never in batchrun's. The venv is made
in steps: the local CPU build of torch first (an unpinned torch from PyPI is CUDA's multi-GB build), then
sentence-transformers with torch held by a constraint so that pip's resolution cannot swap it.

`python -m benchmarks.peers.sentence_transformers.env` makes the venv (or says why it cannot) and prints its
python.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from benchmarks.peers import venv
from benchmarks.peers.venv import PeerSetup, PeerVenv, pip_keeping_torch

SENTENCE_TRANSFORMERS = "sentence-transformers==6.3.0"
VENV = PeerVenv("sentence-transformers", "sentence-transformers",
                ".ready-" + SENTENCE_TRANSFORMERS.replace("==", "_"), [SENTENCE_TRANSFORMERS])
WORKER = "benchmarks.peers.sentence_transformers.worker"


def is_ready() -> bool:
    """The venv has been made (ensure_venv would not download anything)."""
    return VENV.is_ready()


def _install(py: Path) -> None:
    """sentence-transformers, with the venv's torch held by a constraint."""
    pip_keeping_torch(py, SENTENCE_TRANSFORMERS)


def ensure_venv() -> Path:
    """The venv's python, making the venv first if needed; raises RuntimeError with the reason if it cannot."""
    return VENV.ensure(_install)


def environment(threads: int) -> dict[str, str]:
    """The worker's environment: nothing of the project's venv on the path, OpenMP-style thread counts, no hub
    access."""
    return venv.environment(threads, TRANSFORMERS_OFFLINE="1")


class SentenceTransformersSetup(PeerSetup):
    """sentence-transformers for one benchmark run: the venv made (or the reason it could not be), then one worker
    per row through the orchestrator's runner."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, ensure_venv)

    def run(self, runner: Any, name: str, base: dict[str, Any], dtype: str, batch_size: int) -> dict[str, Any]:
        """One worker embedding the row's texts; {"error": ...} (a failed row in the report) without a venv."""
        config = {"dtype": dtype, "batch_size": batch_size}
        if self.python is None:
            return {"error": f"sentence-transformers not run: {self.error}", "config": config}
        res = runner(name, {**base, **config}, python=str(self.python), env=environment(self.threads), module=WORKER)
        if "error" in res:
            res["config"] = config
        return res


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    try:
        py = ensure_venv()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
