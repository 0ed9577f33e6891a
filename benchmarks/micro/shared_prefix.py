"""Rows sharing a system prompt, all queued at once: `python -m benchmarks.micro.shared_prefix [--rows 256]`.

The start of a batch job (and of every batch a Ray replica takes): many rows that begin with the same
system prompt arrive together and are admitted in the same steps. With prefix caching on, the first row
admitted computes the prompt's full blocks and the rows admitted after it in that step map them; with it off,
every row computes the whole prompt. For each setting it queues every row on one engine
and reports the time to the first finished row, the total time, the prompt tokens computed and the
prefix-cache hits, then checks that both settings gave the same greedy tokens. On a shared machine the wall
times are noisy; the CPU seconds of the process (all its threads) and the tokens computed much less so.
"""

from __future__ import annotations

import json
import time

import batchrun  # noqa: F401 - OpenMP settings before torch

# isort: split
import torch

from benchmarks.harness.cli_args import parser
from benchmarks.harness.plans import THREADS
from benchmarks.harness.workload import LengthDist, shared_prefix


def measure(model: str, rows: int, prefix_len: int, suffix_len: int, output_len: int, caching: bool,
            max_num_batched_tokens: int, block_size: int) -> tuple[dict[str, float], list[list[int]]]:
    from batchrun import LLM, SamplingParams
    from batchrun.model.weights.builtin import builtin_path

    path = builtin_path(model)
    max_len = prefix_len + suffix_len + output_len
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=block_size, max_num_seqs=rows,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=caching, max_model_len=max_len,
              # room for every row's own copy of the prompt: the two settings differ in compute only
              num_kv_blocks=rows * -(-(max_len + 1) // block_size) + 16)
    # warm-up (kernels, allocator) on a prompt shorter than a block: nothing for the prefix cache to keep
    llm.generate([{"prompt_token_ids": [5] * (block_size - 1)}], SamplingParams(max_tokens=2), use_tqdm=False)
    before = llm.metrics()
    wl = shared_prefix(rows, prefix_len, llm.engine.runner.model.config.vocab_size, 0,
                       LengthDist(suffix_len, 0.0, suffix_len, suffix_len),
                       LengthDist(output_len, 0.0, output_len, output_len))
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(wl.prompts):
        eng.add_request(str(i), None, prompt, params, i)
    tokens: dict[str, list[int]] = {}
    t0, cpu0, model0 = time.perf_counter(), time.process_time(), eng.runner.model_time_s
    first = None
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            if first is None:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    cpu, model_s = time.process_time() - cpu0, eng.runner.model_time_s - model0
    m = {k: v - before[k] for k, v in eng.metrics_dict().items()
         if k in ("prompt_tokens", "prefix_cache_hit_tokens", "num_steps")}
    eng.check_idle()
    computed = m["prompt_tokens"] - m["prefix_cache_hit_tokens"]
    return ({"prefix_caching": caching, "first_completion_s": first, "total_s": total,
             "cpu_s": cpu, "model_s": model_s,
             "prompt_tokens": m["prompt_tokens"], "prompt_tokens_computed": computed,
             "prefix_cache_hit_tokens": m["prefix_cache_hit_tokens"], "steps": m["num_steps"]},
            [tokens[str(i)] for i in range(rows)])


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, model="tiny-llama", block_size=16, json_path="--json")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    print(f"{args.model}, {THREADS} threads: {args.rows} rows, a {args.prefix_len}-token shared prompt, "
          f"{args.suffix_len}-token suffixes, {args.output_len} output tokens, step budget "
          f"{args.max_num_batched_tokens}")
    print(f"{'prefix cache':>12} {'first s':>8} {'total s':>8} {'cpu s':>7} {'model s':>8} {'computed':>9} "
          f"{'hits':>7} {'steps':>6}")
    rows, outputs = [], []
    for caching in (False, True):
        r, toks = measure(args.model, args.rows, args.prefix_len, args.suffix_len, args.output_len, caching,
                          args.max_num_batched_tokens, args.block_size)
        rows.append(r)
        outputs.append(toks)
        print(f"{'on' if caching else 'off':>12} {r['first_completion_s']:>8.2f} {r['total_s']:>8.2f} "
              f"{r['cpu_s']:>7.1f} {r['model_s']:>8.2f} {r['prompt_tokens_computed']:>9} {r['prefix_cache_hit_tokens']:>7} {r['steps']:>6}", flush=True)
    same = sum(a == b for a, b in zip(*outputs))
    off, on = rows
    print(f"speed-up: first completion x{off['first_completion_s'] / on['first_completion_s']:.2f}, "
          f"total x{off['total_s'] / on['total_s']:.2f}; identical greedy outputs: {same}/{args.rows}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "identical_outputs": same}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
