"""What batch_invariant costs: `python -m benchmarks.micro.invariant_cost [--model M] [--dtype bfloat16] [--repeats 3]`.

Times one `LLM.generate` over the same prompts with batch_invariant off and on, each in a fresh process, the two in
turn within each of --repeats rounds (a machine's speed drifts over minutes: only the ratio within a round is read),
and prints each round's wall times and the ratio on / off. The workload: --prompts random prompts of 64-300 tokens,
--max-tokens generated tokens each, greedy with EOS ignored, so both runs compute exactly the same tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from benchmarks.harness.cli_args import parser

# One timed generate in a child process (argv: model, dtype, invariant 0/1, prompts, max_tokens): load and a short
# warm-up untimed, then the whole workload; prints {"seconds": ...}.
CHILD = """
import json, random, sys, time
from batchrun import LLM, SamplingParams
model, dtype, invariant, prompts, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, dtype=dtype, batch_invariant=invariant)
rng = random.Random(0)
vocab = llm.config.vocab_size
rows = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(rng.randrange(64, 301))]} for _ in range(prompts)]
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
llm.generate(rows[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
start = time.perf_counter()
llm.generate(rows, params, use_tqdm=False)
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def timed(model: str, dtype: str, invariant: bool, prompts: int, max_tokens: int) -> float:
    proc = subprocess.run([sys.executable, "-c", CHILD, model, dtype, "1" if invariant else "0", str(prompts),
                           str(max_tokens)], capture_output=True, text=True, env=os.environ, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, model="builtin:smollm2-135m-instruct", repeats=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    ratios = []
    for r in range(args.repeats):
        off = timed(args.model, args.dtype, False, args.prompts, args.max_tokens)
        on = timed(args.model, args.dtype, True, args.prompts, args.max_tokens)
        ratios.append(on / off)
        print(f"round {r + 1}: off {off:.1f} s, on {on:.1f} s, on / off {on / off:.2f}", flush=True)
    print(f"{args.model} {args.dtype}: batch_invariant costs {statistics.median(ratios):.2f}x the default's time "
          f"(median of {len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
