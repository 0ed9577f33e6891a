"""benchmarks.gpu.check, the script a session lent a GPU runs (benchmarks/gpu/session.sh), in its CPU dry run:
every part but the kernel tests runs on the tiny model under Triton's interpreter, the end-to-end part with two of
its configurations (each takes seconds here; the others share their code). Device time is scarce: a script broken here would spend a session's GPU on a
traceback. Nothing about speed is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from batchrun.kernels.triton.quant_matmul import PATHS

REPO = Path(__file__).resolve().parent.parent


def test_the_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu.check", "--dry-run", "--skip", "tests",
                           "--e2e-runs", "graphs,int4,kv-fp8", "--json-out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    runs = report["end to end"]["runs"]
    for name in ("batchrun (CUDA graphs)", "batchrun, int4 weights (CUDA graphs)",
                 "batchrun, fp8_e4m3 KV cache (CUDA graphs)"):
        run = runs[name]
        assert run["gen_tokens"] == report["end to end"]["gen_tokens"] and run["gen_tok_per_s"] > 0
        # the timed run's own steps (the warm-up pass's subtracted), each timer within the step's time
        assert 0 < run["metrics"]["num_steps"] and run["metrics"]["forward_time_s"] <= run["metrics"]["step_time_s"]
    assert runs["HF continuous batching"] == {"error": "not asked for (--e2e-runs)"}
    assert "ms per step: step" in proc.stdout
    points = report["quantized matmul"]
    assert points and all(set(p["path_ms"]) == set(PATHS) and p["chosen"] in PATHS for p in points)
    assert report["quantized matmul sweep"] and report["decode bandwidth"]
