"""A model as large as the machine holds: a job on a Llama-3.1-8B-shaped bf16 checkpoint, with its peak RSS.

Makes a checkpoint of the shape with random bf16 weights, shard by shard (a shard's tensors at a time, so the
machine never holds the model while writing it), then runs a job of --requests prompts on it with `batchrun run`
and the default engine settings, in a child process whose own peak RSS (VmHWM) is the figure. The report (one JSON
object, also to --json) has the exit code, tokens/s, the weights' size from the checkpoint's headers, the KV pool
the engine chose (from _metrics.json) and the bound it is held to: peak RSS <= 1.15 x weights + KV pool + 1 GiB.

    python -m benchmarks.micro.large_model --dir /tmp/llama8b            # the 8B shape: 15 GiB of disk, ~18 GiB of RAM
    python -m benchmarks.micro.large_model --shape small --dir /tmp/lm    # the same steps on a 0.3 GiB model
    python -m benchmarks.micro.large_model --dir /tmp/llama8b --vllm     # and the same prompts through vLLM's CPU build

With --vllm, the job's prompts also go through vLLM's CPU build (its own venv, benchmarks/peers/vllm/env.py; greedy, the
same tokens each, EOS ignored) in a child process, after batchrun's job; both sides report load and generation
separately: `generate_tokens_per_s` counts generation alone (batchrun: LLM.generate in a child process like
vLLM's, so that the two are measured alike), `generated_tokens_per_s` batchrun's whole `batchrun run`.

The checkpoint is kept in --dir and reused by later runs (delete the folder to make it afresh). Run the 8B shape
on a machine nothing else is using: its memory is the point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import models
from benchmarks.harness.cli_args import parser

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": models.SHAPES["llama-3.1-8b"],
    # a few hundred MB: big enough that a second copy of the weights shows in the peak, small enough for a test
    "small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32768, max_position_embeddings=4096, tie_word_embeddings=False),
}


def write_job(folder: Path, model: Path, requests: int, max_tokens: int) -> Path:
    """A job of `requests` English prompts (the built-in corpus), greedy, `max_tokens` each, default engine."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrun.model.weights.builtin import synthetic_corpus

    lines = synthetic_corpus(requests * 8, seed=1)
    prompts = [" ".join(lines[8 * i : 8 * i + 8]) for i in range(requests)]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt": prompts}), folder / "prompts.parquet")
    job = folder / "job.yaml"
    job.write_text(f"model:\n  path: {model}\n  dtype: bfloat16\n"
                   f"input:\n  path: {folder / 'prompts.parquet'}\n"
                   f"output:\n  path: {folder / 'out'}\n"
                   f"sampling:\n  max_tokens: {max_tokens}\n  temperature: 0.0\n  ignore_eos: true\n")
    return job


# `batchrun run` in this process, its peak RSS (VmHWM: this process's own; a child's ru_maxrss starts at the peak of
# the process it was forked from, e.g. a test run's) written at exit to argv[1]
PEAK_WRAPPER = """
import atexit, sys
from batchrun.cli import main
def peak():
    hwm = next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    open(sys.argv[1], "w").write(str(int(hwm) * 1024))
atexit.register(peak)
main(sys.argv[2:], prog_name="batchrun")
"""


# argv: engine ("batchrun" or "vllm"), the model, the prompts' parquet file, max tokens, the JSON of extra engine
# arguments (batchrun's LLM: quantization, ...). Load, then generate, each timed; peak RSS (VmHWM) at the end.
GENERATE_SCRIPT = """
import json, sys, time
import pyarrow.parquet as pq
engine, model, prompts_file, max_tokens, extra = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
prompts = pq.read_table(prompts_file).column("prompt").to_pylist()
start = time.monotonic()
if engine == "vllm":
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype="bfloat16", seed=0, kv_cache_memory_bytes=2 * 2**30, max_model_len=4096)
    kwargs = {}
else:
    from batchrun import LLM, SamplingParams
    llm = LLM(model, dtype="bfloat16", **json.loads(extra))
    kwargs = {"use_tqdm": False}
load = time.monotonic() - start
start = time.monotonic()
outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), **kwargs)
wall = time.monotonic() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
hwm = next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps({"load_s": round(load, 1), "generate_s": round(wall, 1), "generated_tokens": tokens,
                  "generate_tokens_per_s": round(tokens / wall, 2), "peak_rss_gib": round(int(hwm) / 2**20, 2)}))
"""


def generate(engine: str, model: Path, work: Path, max_tokens: int, extra: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """The job's prompts through `engine`'s Python API in a child process (vLLM: in its venv, with its
    recommended CPU environment): load and generation timed apart, and the peak RSS."""
    if engine == "vllm":
        from benchmarks.peers.vllm import env as vllm_env

        py = vllm_env.ensure_venv()
        command, env = [str(py)], vllm_env.environment(py, len(os.sched_getaffinity(0)))
    else:
        command, env = [sys.executable], dict(os.environ)
    proc = subprocess.run([*command, "-c", GENERATE_SCRIPT, engine, str(model), str(work / "prompts.parquet"),
                           str(max_tokens), json.dumps(extra or {})], env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"exit_code": proc.returncode, "stderr_tail": proc.stderr.splitlines()[-3:]}
    return {"exit_code": 0, **json.loads(proc.stdout.strip().splitlines()[-1])}


def run(model: Path, work: Path, requests: int, max_tokens: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the job in a child process; its exit code, wall time, tokens/s, peak RSS and the bound."""
    from batchrun.engine_args import EngineArgs
    from batchrun.model.runner.memory import checkpoint_weight_bytes
    from batchrun.model.weights.loader import weight_files

    job = write_job(work, model, requests, max_tokens)
    peak_file = work / "peak_rss"
    peak_file.unlink(missing_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, "-c", PEAK_WRAPPER, str(peak_file), "run", str(job), "--no-resume"],
                              env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=err, text=True)
        err.seek(0)
        stderr = err.read()
    wall = time.monotonic() - start
    peak = int(peak_file.read_text()) if peak_file.is_file() else 0
    weights = checkpoint_weight_bytes(model, 2)
    metrics_file = work / "out" / "_metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    engine = metrics.get("engine", {})
    block_size = EngineArgs.__dataclass_fields__["block_size"].default  # the job leaves it at the default
    kv = engine.get("kv_blocks_total", 0) * engine.get("kv_bytes_per_token", 0) * block_size
    bound = 1.15 * weights + kv + models.GIB
    log_lines = [ln for ln in stderr.splitlines()
                 if any(what in ln for what in ("few-row copy", "KV cache sized", "KV cache:", "needs"))]
    return {"exit_code": proc.returncode, "wall_s": round(wall, 1), "requests": requests,
            "generated_tokens_per_s": metrics.get("generated_tokens_per_s"),
            "weights_gib": round(weights / models.GIB, 2), "checkpoint_files": len(weight_files(model)),
            "kv_pool_gib": round(kv / models.GIB, 2), "peak_rss_gib": round(peak / models.GIB, 2),
            "bound_gib": round(bound / models.GIB, 2), "within_bound": peak <= bound, "engine_log": log_lines,
            "stderr_tail": stderr.splitlines()[-3:] if proc.returncode else []}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, json_path="--json")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help="the model (default %(default)s)")
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoint and the job go")
    ap.add_argument("--requests", type=int, default=16, help="prompts in the job (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each (default %(default)s)")
    ap.add_argument("--vllm", action="store_true", help="the same prompts through vLLM's CPU build too")
    ap.add_argument("--quantization", default=None,
                    help="also generate with batchrun's model.quantization set to this (int8, int4, ...)")
    args = ap.parse_args(argv)
    model = models.write_checkpoint(args.dir / f"{args.shape}-bf16", SHAPES[args.shape])
    report = {"shape": args.shape, **run(model, args.dir / "job", args.requests, args.max_tokens)}
    if args.vllm or args.quantization:
        report["generate"] = {"batchrun": generate("batchrun", model, args.dir / "job", args.max_tokens)}
        if args.quantization:
            report["generate"][f"batchrun {args.quantization}"] = generate(
                "batchrun", model, args.dir / "job", args.max_tokens, {"quantization": args.quantization})
        if args.vllm:
            report["generate"]["vllm"] = generate("vllm", model, args.dir / "job", args.max_tokens)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if report["exit_code"] == 0 and report["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
