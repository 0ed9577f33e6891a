"""The CPU kernels (csrc/*.c): one library built on first use with the system C compiler, called through ctypes;
cached by its sources, the compiler, the flags and the CPU; its OpenMP loops share torch's threads. Without a
compiler, or with BATCHRUN_CPU_KERNELS=0, ops take their torch paths. The families: docs/cpu-kernels.md."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# -ffp-contract=fast: fused multiply-adds, as MKL's matmuls use (ISO C mode would turn them off)
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c99"]


def _flags(march: str | None = None) -> list[str]:
    """The flags, for -march=`march` (default BATCHRUN_CPU_MARCH, else native)."""
    march = march or os.environ.get("BATCHRUN_CPU_MARCH") or "native"
    return [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]

# A function's (return type, argument types); most kernels end with the dtype flag (dtype_flag).
Signature = tuple[type | None, list]
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take


def sources(folder: Path = CSRC) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".c", ".h")}


def _cpu_signature() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compiler_version(cc: str) -> bytes:
    """`cc --version`: an upgraded compiler at the same path builds afresh."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _cache_key(files: Mapping[str, bytes], cc: str, flags: list[str] | None = None) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{len(files[name])}\0".encode())
        h.update(files[name])
    h.update(" ".join([cc, *(flags or _flags()), _cpu_signature()]).encode())
    h.update(_compiler_version(cc))
    return h.hexdigest()[:16]


def declare(lib: ctypes.CDLL, signatures: Mapping[str, Signature]) -> None:
    for name, (restype, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, args


def build(files: Mapping[str, bytes], signatures: Mapping[str, Signature], march: str | None = None
          ) -> ctypes.CDLL | None:
    """Compile `files` (name -> text) into one cached library for `march`, `signatures` declared; None on failure."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: CPU ops use their torch paths")
        return None
    from batchrun.paths import cache_dir

    flags = _flags(march)
    lib = cache_dir() / "kernels" / f"cpu_kernels-{_cache_key(files, cc, flags)}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=lib.parent))
        try:
            for name, text in files.items():
                (work / name).write_bytes(text)
            c_files = [str(work / name) for name in sorted(files) if name.endswith(".c")]
            subprocess.run([cc, *flags, "-o", str(work / "out.so"), *c_files, "-lm"], check=True,
                           capture_output=True, timeout=300)
            os.replace(work / "out.so", lib)
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            log.warning("building the CPU kernels failed (%s %s); using the torch paths", e,
                        err.decode(errors="replace")[:200])
            return None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    so = ctypes.CDLL(str(lib))
    declare(so, signatures)
    return so


@cache
def _shared() -> ctypes.CDLL | None:
    if os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0":
        return None
    return build(sources(), {})


def library(signatures: Mapping[str, Signature]) -> ctypes.CDLL | None:
    """The library with `signatures` declared, or None where it is not built."""
    lib = _shared()
    if lib is not None:
        declare(lib, signatures)
    return lib


def available() -> bool:
    return _shared() is not None


def dtype_flag(x: torch.Tensor) -> int:
    """The kernels' dtype flag: 0 fp32, 1 bf16."""
    return int(x.dtype == torch.bfloat16)
