"""What the peers share: a virtualenv of their own under the batchrun cache, made on first use, the environment
their processes run in, and the cache key of a checkpoint they convert.

A peer pins packages that conflict with the project's venv (its own torch, an older transformers), so it gets
`$BATCHRUN_CACHE/<name>-venv`, made in steps: a bare venv, the local CPU build of torch (an unpinned torch from
PyPI is CUDA's multi-GB build), then the peer's own packages. A stamp file named after its pins marks it made.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from batchrun.paths import cache_dir
from benchmarks.harness.runner import worker_environ

TORCH = ("torch==2.13.0+cpu", "torch==2.13.0")  # the local CPU build first: plain 2.13.0 on PyPI is CUDA's
# What ties a process to the project's venv: a peer's processes run without them.
PROJECT_VARS = ("PYTHONPATH", "LD_PRELOAD", "VIRTUAL_ENV")
# What a conversion reads from a checkpoint: its key hashes these files' names, sizes and mtimes (a checkpoint
# rewritten in place gets a new key; hashing the bytes of a 2 GB model would cost seconds each run).
KEY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "special_tokens_map.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def pip(py: Path, *args: str, timeout: float = 3600) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", *args], check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def pip_keeping_torch(py: Path, *packages: str) -> None:
    """Install packages into a peer's venv with its torch held by a constraint (requirements that name torch
    unpinned would otherwise replace the CPU build)."""
    torch_version = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"], check=True,
                                   timeout=300, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_version}\n")
        pip(py, "-c", str(constraints), *packages)


class PeerVenv:
    """One peer's venv, `$BATCHRUN_CACHE/<name>-venv`; `label` names the peer in errors, `pins` go in its stamp."""

    def __init__(self, name: str, label: str, stamp: str, pins: Sequence[str]) -> None:
        self.name, self.label, self.stamp, self.pins = name, label, stamp, tuple(pins)

    @property
    def dir(self) -> Path:
        return cache_dir() / f"{self.name}-venv"

    @property
    def python(self) -> Path:
        return self.dir / "bin" / "python"

    def is_ready(self) -> bool:
        """The venv has been made (ensure would not download anything)."""
        return (self.dir / self.stamp).is_file() and self.python.is_file()

    def ensure(self, install: Callable[[Path], None]) -> Path:
        """The venv's python, making the venv first if needed (`install(python)` adds the peer's packages after
        torch); raises RuntimeError with the reason if it cannot."""
        py = self.python
        if self.is_ready():
            return py
        try:
            if not py.is_file():
                # the venv's base is the interpreter under the project's venv: nothing of the project carries over
                subprocess.run([sys.executable, "-m", "venv", str(self.dir)], check=True, timeout=300,
                               capture_output=True)
            for torch_req in TORCH:
                try:
                    pip(py, torch_req)
                    break
                except subprocess.CalledProcessError:
                    continue
            else:
                raise RuntimeError(f"could not install {' or '.join(TORCH)} into {self.dir}")
            install(py)
        except subprocess.CalledProcessError as e:
            err = e.stderr or b""
            err = (err.decode(errors="replace") if isinstance(err, bytes) else err).strip().splitlines()
            raise RuntimeError(f"making the {self.label} venv failed: {' | '.join(err[-3:]) or e}") from e
        except (OSError, subprocess.TimeoutExpired, StopIteration) as e:
            raise RuntimeError(f"making the {self.label} venv failed: {e}") from e
        (self.dir / self.stamp).write_text("\n".join(self.pins) + "\n")
        return py


def environment(threads: int, drop: Sequence[str] = (), **values: str) -> dict[str, str]:
    """A peer process's environment: this one's (less batchrun's OpenMP wait setting, worker_environ) less
    PROJECT_VARS and `drop`, OpenMP-style thread counts, no hub access, and `values`."""
    env = {k: v for k, v in worker_environ().items() if k not in (*PROJECT_VARS, *drop)}
    env.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **values})
    return env


def checkpoint_key(checkpoint: Path) -> str:
    """A short hash of what a conversion reads: the names, sizes and mtimes of the checkpoint's config, tokenizer
    and weight files."""
    files = sorted(p for p in checkpoint.iterdir()
                   if p.is_file() and (p.name in KEY_FILES or p.name.endswith(WEIGHT_SUFFIXES)))
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


class PeerSetup:
    """A peer for one benchmark run: its venv made by `ensure` (or the reason it could not be)."""

    def __init__(self, threads: int, ensure: Callable[[], Path]) -> None:
        self.threads = threads
        self.python: Path | None = None
        self.error: str | None = None
        try:
            self.python = ensure()
        except RuntimeError as e:
            self.error = str(e)
