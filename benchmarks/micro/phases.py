"""Where batchrun gains or loses against vLLM: `python -m benchmarks.micro.phases [--model smollm2] [--dtype bfloat16]`.

`benchmarks.run` gives one number per workload; this splits it into the phases a workload is made of, timed the
same way in both engines, each in its own process (vLLM's with its recommended CPU setup, peers/vllm/env.py):
  - a decode step with 4 running sequences (the long tail of a workload) and with 64 (its busy middle): the time
    of 110 generated tokens minus that of 10, over 100, for sequences of a 150-token prompt;
  - prefill throughput: 64 prompts of 128 tokens, one generated token each.
Every call uses prompts no earlier call used (both engines cache prefixes). Each figure is the best of
--repeats. The two engines alternate --rounds times, since a machine's speed drifts over minutes: compare
figures within a round.

    python -m benchmarks.micro.phases --model smollm2 --dtype float32 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.cli_args import parser
from benchmarks.harness.workload import ModelShape

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("tiny", "small", "smollm2")  # benchmarks.run's plans of these names give the built-in model
KV_BLOCKS, BLOCK_SIZE = 4000, 8  # batchrun's KV pool; vLLM gets the same bytes
DECODE_BATCHES = (4, 64)
DECODE_PROMPT = 150
PREFILL = (64, 128)  # prompts x tokens


def _prompts(call: int, count: int, length: int, vocab: int) -> list[list[int]]:
    """count prompts of `length` ids (ids >= 10, below vocab), none sharing its first two ids with another prompt
    of any call (count <= 1000): so no prompt shares even its first KV block with another."""
    span = vocab - 10
    prompts = []
    for i in range(count):
        uid = 1000 * call + i
        head = [10 + uid % span, 10 + uid // span % span]
        prompts.append((head + [(7 * j + 13 * i) % span + 10 for j in range(length - 2)])[:length])
    return prompts


def measure(generate: Callable[[list[list[int]], int], None], vocab: int, repeats: int) -> dict[str, float]:
    """The phase figures for one engine, given generate(prompts, exact output tokens)."""
    calls = iter(range(1, 10**6))

    def timed(count: int, length: int, tokens: int) -> float:
        prompts = _prompts(next(calls), count, length, vocab)
        t = time.perf_counter()
        generate(prompts, tokens)
        return time.perf_counter() - t

    timed(2, 16, 2)  # warm-up
    out: dict[str, float] = {}
    for batch in DECODE_BATCHES:
        short = min(timed(batch, DECODE_PROMPT, 10) for _ in range(repeats))
        long = min(timed(batch, DECODE_PROMPT, 110) for _ in range(repeats))
        out[f"decode_ms_{batch}"] = (long - short) / 100 * 1e3
    count, length = PREFILL
    out["prefill_tok_s"] = count * length / min(timed(count, length, 1) for _ in range(repeats))
    return out


def run_batchrun(model: str, dtype: str, repeats: int) -> dict[str, float]:
    import torch

    import batchrun  # noqa: F401  (sets the OpenMP defaults before torch loads)
    from batchrun import LLM
    from benchmarks.harness.worker import _sampling

    torch.set_num_threads(2)
    # no draft tokens: a phase is a kernel comparison, with vLLM at its defaults (benchmarks.run has both drafting)
    llm = LLM(model, dtype=dtype, device="cpu", num_kv_blocks=KV_BLOCKS, block_size=BLOCK_SIZE,
              num_speculative_tokens=0)

    def generate(prompts: list[list[int]], tokens: int) -> None:
        llm.generate([{"prompt_token_ids": p} for p in prompts], _sampling(tokens), use_tqdm=False)

    return measure(generate, llm.engine.runner.model.config.vocab_size, repeats)


def run_vllm(model: str, dtype: str, repeats: int) -> dict[str, float]:
    from vllm import LLM

    from benchmarks.peers.vllm.worker import _params, _prompts

    shape = dataclasses.replace(ModelShape.from_checkpoint(model), dtype_bytes=2 if dtype == "bfloat16" else 4)
    llm = LLM(model=model, dtype=dtype, seed=0, max_model_len=2048,
              kv_cache_memory_bytes=KV_BLOCKS * BLOCK_SIZE * shape.kv_bytes_per_token)

    def generate(prompts: list[list[int]], tokens: int) -> None:
        llm.generate(_prompts(prompts), _params(tokens), use_tqdm=False)

    return measure(generate, llm.llm_engine.model_config.get_vocab_size(), repeats)


def _child(system: str, model: str, dtype: str, repeats: int) -> dict[str, Any]:
    """One engine's figures, from a process of its own."""
    cmd = ["-m", "benchmarks.micro.phases", "--system", system, "--model-path", model, "--dtype", dtype,
           "--repeats", str(repeats)]
    if system == "vllm":
        from benchmarks.peers.vllm.env import ensure_venv, environment

        py = ensure_venv()
        env = environment(py, 2)
    else:
        py, env = Path(sys.executable), dict(os.environ)
    proc = subprocess.run([str(py), *cmd], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, repeats=2)
    ap.add_argument("--model", choices=MODELS, default="smollm2")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--rounds", type=int, default=1, help="batchrun then vLLM, this many times")
    ap.add_argument("--system", choices=("batchrun", "vllm"), help=argparse.SUPPRESS)  # a child process
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.system:
        run = run_batchrun if args.system == "batchrun" else run_vllm
        print(json.dumps(run(args.model_path, args.dtype, args.repeats)))
        return 0
    from batchrun.model.weights.builtin import builtin_path
    from benchmarks.harness.plans import PLANS

    model = str(builtin_path(PLANS[args.model].builtin))
    keys = [f"decode_ms_{b}" for b in DECODE_BATCHES] + ["prefill_tok_s"]
    print(f"| round | system | {' | '.join(keys)} |\n|---|---|{'---:|' * len(keys)}")
    for rnd in range(1, args.rounds + 1):
        figures = {s: _child(s, model, args.dtype, args.repeats) for s in ("batchrun", "vllm")}
        for s, f in figures.items():
            print(f"| {rnd} | {s} | {' | '.join(f'{f[k]:.1f}' for k in keys)} |")
        # batchrun / vLLM speed: time ratios inverted for the decode steps
        speed = [figures["vllm"][k] / figures["batchrun"][k] for k in keys[:-1]]
        speed.append(figures["batchrun"][keys[-1]] / figures["vllm"][keys[-1]])
        print(f"| {rnd} | batchrun speed / vLLM's | {' | '.join(f'{x:.2f}x' for x in speed)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
