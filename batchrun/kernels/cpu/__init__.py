"""CPU kernels (csrc/*.c): one shared library, built on first use and called through ctypes.

On a CPU, decode attention and the element-wise ops of a layer are bound by memory traffic and per-op
dispatch: gathering every decode sequence's blocks before SDPA moves each K/V byte three times, and torch
runs an RMSNorm as five passes. The C kernels make one pass each and read K/V in place through the block
tables. They are plain C99 compiled with the system C compiler (no torch headers, so they build in a few
seconds) into the batchrun cache, keyed by every source and header, the compiler, the flags and the CPU. Their
OpenMP loops run on torch's own OpenMP runtime (torch ships libgomp.so.1 and has it loaded when the library
loads), so the two never fight over the cores. Without a compiler, or with BATCHRUN_CPU_KERNELS=0, every op
takes its torch path.

The kernels by family: one C file in csrc/ and one module of ctypes wrappers here each.
    attention     paged_attention, store_kv                        csrc/attention.c     attention.py
    elementwise   rms_norm, silu_mul, rope                         csrc/elementwise.c   elementwise.py
    sampling      logits_top, apply_token_bitmask                  csrc/sampling.c      sampling.py
    linears       pack_*_linear, linear_f32, linear_bf16 (+ AMX)   csrc/linears.c       linears.py
    quantized     pack_int8/int4_linear, quant_linear (+ VNNI)    csrc/quant_linears.c quant.py
    gptq          gptq_block (GPTQ's per-input loop, at load)      csrc/gptq.c          gptq.py
csrc/common.h holds what they share (the CPU feature dispatch, vector types, bf16 conversions, exp); csrc/common.c
the one shared state (whether AMX is allowed). This module only builds and loads the library: a family module
declares its functions' ctypes signatures (its SIGNATURES) and reaches the library through library(SIGNATURES).

BATCHRUN_CPU_MARCH (default `native`) is the -march the library is built for: `x86-64-v3` (AVX2, FMA, no
AVX-512) builds, on an AVX-512 machine, the kernels an AVX2-only CPU (Haswell to Skylake client, AMD Zen 1-3) runs,
so that their paths can be tested and timed here (tests/test_quant_avx2.py); `x86-64` gives plain C without AVX.
A library built for a target the CPU lacks does not run (illegal instruction). It is part of the cache key.

Each wrapper takes fp32 or bf16 CPU tensors (all of one dtype, but for the fp32 rotary tables) whose
innermost dimension is contiguous; bf16 is computed with fp32 arithmetic and accumulation. Whether a model
uses them is decided once, at load (ops.select_ops, backends.select_backend), not per call.
"""

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
    """The compiler flags, -march=`march` (default: BATCHRUN_CPU_MARCH, else native) in place of -march=native."""
    march = march or os.environ.get("BATCHRUN_CPU_MARCH") or "native"
    return [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]

# A function's (return type, argument types); the last int argument of most kernels is the dtype flag:
# 0 fp32, 1 bf16 (dtype_flag).
Signature = tuple[type | None, list]
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels take


def sources(folder: Path = CSRC) -> dict[str, bytes]:
    """The library's sources by file name: every .c file (each compiled) and .h file (included)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".c", ".h")}


def _cpu_signature() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compiler_version(cc: str) -> bytes:
    """`cc --version`, so that an upgraded compiler at the same path builds afresh."""
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
    """Set each named function's return and argument types (ctypes keeps them on the library's function)."""
    for name, (restype, args) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, args


def build(files: Mapping[str, bytes], signatures: Mapping[str, Signature], march: str | None = None
          ) -> ctypes.CDLL | None:
    """Compile the C sources `files` (file name -> text; the .c files in one command, into one library, cached by
    all of them, the compiler, the flags and the CPU) for `march` (default: BATCHRUN_CPU_MARCH, else native) and
    declare `signatures`; None without a compiler or if the build fails. The benchmarks also build an older
    revision's sources with it (one cpu_kernels.c before the split), the tests the AVX2 kernels (march x86-64-v3)."""
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
    """The one library, with `signatures` declared; None where it is not available. Each family module calls it
    once (cached) with its own signatures."""
    lib = _shared()
    if lib is not None:
        declare(lib, signatures)
    return lib


def available() -> bool:
    return _shared() is not None


def dtype_flag(x: torch.Tensor) -> int:
    """The kernels' dtype flag."""
    return int(x.dtype == torch.bfloat16)
