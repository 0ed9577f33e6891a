"""The workers' starter: one process per system and configuration, its spec, result and log under out/work/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.plans import THREADS

ROOT = Path(__file__).resolve().parents[2]


def worker_environ() -> dict[str, str]:
    """This process's environment less the OpenMP wait setting batchrun's import chose for this process
    (batchrun.OPENMP_SET): each worker, batchrun's or a peer's, then waits as a process started on its own would."""
    import batchrun

    return {k: v for k, v in os.environ.items() if batchrun.OPENMP_SET.get(k) != v}


class Runner:
    """Starts workers, one process each, and keeps their specs, results and logs under out/work/."""

    def __init__(self, out: Path, timeout_s: float, verbose: bool = True) -> None:
        self.work = out / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.verbose = verbose
        self.env = {**worker_environ(), "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS),
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
                        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def log(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def __call__(self, name: str, spec: dict[str, Any], python: str | None = None, env: dict[str, str] | None = None,
                 module: str = "benchmarks.harness.worker") -> dict[str, Any]:
        """Run one worker (`module`, by default batchrun's and transformers'; another python and environment
        for systems in their own venv) and return its result, or {"error": why}."""
        spec = {"threads": THREADS, **spec}
        spec_path, out_path, log_path = (self.work / f"{name}.{ext}" for ext in ("spec.json", "result.json", "log"))
        spec_path.write_text(json.dumps(spec))
        out_path.unlink(missing_ok=True)
        t = time.perf_counter()
        with log_path.open("w") as log:
            try:
                proc = subprocess.run([python or sys.executable, "-m", module, str(spec_path), str(out_path)],
                                      cwd=ROOT, env={**(env or self.env), "PYTHONPATH": str(ROOT)} if env else self.env,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      timeout=self.timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        took = time.perf_counter() - t
        if rc == 0 and out_path.is_file():
            res = json.loads(out_path.read_text())
            shown = ("done" if "wall_s" not in res else f"{res['items'] / res['wall_s']:.2f} items/s" if "items" in res
                     else f"{res['gen_tokens'] / res['wall_s']:.1f} gen tok/s")
            self.log(f"  {name}: {shown} ({took:.0f} s in all)")
            return res
        tail = log_path.read_text().strip().splitlines()[-3:] if log_path.is_file() else []
        why = f"timed out after {self.timeout_s:.0f} s" if rc is None else f"exit code {rc}"
        err = f"{why}: {' | '.join(tail)} (log: {log_path.relative_to(self.work.parent)})"
        self.log(f"  {name}: FAILED, {err}")
        return {"error": err}
