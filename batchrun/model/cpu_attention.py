"""The CPU decode-attention kernel (csrc/paged_decode.c): built on first use, called through ctypes.

Gathering every decode sequence's blocks into a contiguous copy before SDPA moves each K/V byte three
times; on a CPU, decode attention is bound by exactly those bytes. The C kernel reads K/V in place
through the block tables, once. It is plain C99 compiled with the system C compiler (no torch headers,
so it builds in about a second) into the batchrun cache, keyed by source, compiler and CPU. Its OpenMP
loop runs on torch's own OpenMP runtime (torch ships libgomp.so.1 and has it loaded when the kernel
loads), so the two never fight over the cores. Without a compiler, or with BATCHRUN_CPU_KERNELS=0, the
torch path is used instead.
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
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c99"]


def _cpu_signature() -> str:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("BATCHRUN_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: CPU decode attention uses the torch path")
        return None
    from batchrun.model.builtin import cache_dir

    src = _SRC.read_bytes()
    key = hashlib.sha256(src + " ".join([cc, *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    lib = cache_dir() / "kernels" / f"paged_decode-{key}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SRC), "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", b"") or b""
            log.warning("building the CPU attention kernel failed (%s %s); using the torch path", e,
                        err.decode(errors="replace")[:200])
            Path(tmp).unlink(missing_ok=True)
            return None
    so = ctypes.CDLL(str(lib))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    so.paged_qk.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32, i64]
    so.paged_pv.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64]
    so.paged_qk.restype = so.paged_pv.restype = None
    return so


def available() -> bool:
    return _library() is not None


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 max_len: int, scale: float) -> torch.Tensor:
    """q [S, Hq, D] fp32 -> [S, Hq, D]; kv_cache [2, NB, BS, Hkv, D] fp32 (one layer); one query per sequence."""
    so = _library()
    s, hq, d = q.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    q = q.contiguous()
    bt = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    k, v = kv_cache[0], kv_cache[1]
    scores = torch.empty(s, hq, max_len, dtype=torch.float32)
    so.paged_qk(q.data_ptr(), k.data_ptr(), bt.data_ptr(), bt.stride(0), lens.data_ptr(), scores.data_ptr(),
                max_len, hq, hkv, d, bs, scale, s)
    probs = scores.softmax(dim=-1)
    out = torch.empty(s, hq, d, dtype=torch.float32)
    so.paged_pv(probs.data_ptr(), v.data_ptr(), bt.data_ptr(), bt.stride(0), lens.data_ptr(), out.data_ptr(),
                max_len, hq, hkv, d, bs, s)
    return out
