"""Engine overhead at scale: `python -m benchmarks.micro.overhead [--seqs 64,256,1024] [--model tiny-llama]`.

For each count N, N requests (16-token prompts, enough output to outlast the measurement) are queued on the
built-in tiny model; once all N are running and the steps are decode-only, it times `Engine.step` for
--steps steps and splits each into the model's forward (the runner's own timer) and everything else:
scheduling, the batch's inputs, sampling, appends, stop checks, outputs. That "everything else" is what a
GPU would expose, where a decode step's forward takes a few milliseconds. Prints one row per N (medians over
the steps) and, with --json, writes them.
"""

from __future__ import annotations

import json
import statistics
import time

import batchrun  # noqa: F401 - OpenMP settings before torch

# isort: split
import torch

from benchmarks.harness.cli_args import parser
from benchmarks.harness.plans import BLOCK_SIZE, THREADS


def measure(model: str, num_seqs: int, steps: int, prompt_len: int = 16) -> dict[str, float]:
    from batchrun import LLM, SamplingParams
    from batchrun.model.weights.builtin import builtin_path

    out_len = steps + 8
    blocks = num_seqs * -(-(prompt_len + out_len + 4) // BLOCK_SIZE)
    llm = LLM(str(builtin_path(model)), dtype="float32", device="cpu", num_kv_blocks=blocks,
              block_size=BLOCK_SIZE, max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs * prompt_len),
              enable_prefix_caching=False, num_speculative_tokens=0)  # no drafts: N decode rows a step, N running
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, min_tokens=out_len, ignore_eos=True)
    for i in range(num_seqs):
        eng.add_request(f"r{i}", None, [3 + (i * 7 + j) % 500 for j in range(prompt_len)], params, i)
    while eng.scheduler.waiting or eng.metrics.num_running < num_seqs:  # prefill everything first
        eng.step()
    eng.step()
    rows = []
    for _ in range(steps):
        t, m0 = time.perf_counter(), eng.metrics.model_time_s
        eng.step()
        total = time.perf_counter() - t
        rows.append((total, eng.metrics.model_time_s - m0))
    running = eng.metrics.num_running
    eng.abort_all()
    step = statistics.median(r[0] for r in rows)
    model_s = statistics.median(r[1] for r in rows)
    over = statistics.median(r[0] - r[1] for r in rows)
    return {"num_seqs": num_seqs, "running_at_end": running, "steps": steps, "step_ms": 1e3 * step,
            "model_ms": 1e3 * model_s, "overhead_ms": 1e3 * over,
            "overhead_min_ms": 1e3 * min(r[0] - r[1] for r in rows), "overhead_share": over / step}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, model="tiny-llama", json_path="--json")
    ap.add_argument("--seqs", default="64,256,1024", help="comma-separated running-sequence counts")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    rows = []
    print(f"{args.model}, {THREADS} threads, decode-only steps (medians over {args.steps})")
    print(f"{'running':>8} {'step ms':>9} {'model ms':>9} {'outside ms':>11} {'(min)':>7} {'share':>6}")
    for n in (int(x) for x in args.seqs.split(",") if x.strip()):
        r = measure(args.model, n, args.steps)
        rows.append(r)
        print(f"{n:>8} {r['step_ms']:>9.2f} {r['model_ms']:>9.2f} {r['overhead_ms']:>11.2f} "
              f"{r['overhead_min_ms']:>7.2f} {r['overhead_share']:>6.1%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
