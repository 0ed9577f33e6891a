"""Structured outputs' cost: a JSON-schema extraction job against the same job unconstrained, same prompts.

    python -m benchmarks.micro.structured                      # builtin:smollm2-135m-instruct, 64 prompts
    python -m benchmarks.micro.structured --num-prompts 8 --max-tokens 48 --repeats 1   # a quick correctness run

Three runs per repeat on one LLM, back to back, with prefix caching off (each run computes every prompt, as
the job would; with it on, every run after the first would find its prompts cached):
- `json_schema`: every prompt constrained by a nested schema (object, enum, integer, array); each output's
  length is recorded, and every output is checked to parse and validate;
- `unconstrained_same_lengths`: no grammar, each prompt generating exactly the length its constrained run
  did (ignore_eos): the same tokens in the same batches, so the ratio is the grammar's overhead alone (the
  target: >= 0.85 of the unconstrained generated tokens per second);
- `unconstrained`: the job as a user would run it without a schema (max_tokens, stops at EOS), for scale.
The ratio is taken per repeat, between its two back-to-back runs, and the median over the repeats is
reported (each run's best over the repeats too): on a shared machine one whole run can be much slower than the
next, so a ratio of two runs far apart in time, or of two bests, measures the machine as much as the grammar.
Prints one JSON object (and writes it to --json-out).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.harness.cli_args import parser  # noqa: E402 - a script run by path finds the package through REPO

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "neutral"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "mood", "hobbies", "address"],
}
NAMES = ["Alice", "Bob", "Carla", "Dan", "Eve", "Farid", "Gina", "Hugo", "Ines", "Jon"]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth"]
HOBBIES = ["chess and hiking", "painting", "football, cooking and jazz", "reading", "sailing and knitting"]


def prompts(tokenizer, n: int) -> list[str]:
    texts = [f"Extract the person as JSON with name, age, mood, hobbies and address.city: {NAMES[i % 10]} is "
             f"{18 + (7 * i) % 60} years old, lives in {CITIES[i % 6]}, likes {HOBBIES[i % 5]} and feels "
             f"{['happy', 'sad', 'fine'][i % 3]}." for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                          add_generation_prompt=True) for t in texts]


def timed(llm, items, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(items, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, model="builtin:smollm2-135m-instruct", repeats=5, json_path="--json-out")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--compact", action="store_true", help="disable_any_whitespace (compact JSON)")
    args = ap.parse_args(argv)

    import jsonschema

    from batchrun import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, dtype="float32", kv_cache_memory="512MiB", max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False)
    items = prompts(llm.tokenizer, args.num_prompts)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=args.compact)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1,
                                 structured_outputs=spec)
    llm.generate(items[:2], constrained, use_tqdm=False)  # warm-up: compile, first forwards
    best: dict[str, dict] = {}
    ratios: list[float] = []
    valid = 0
    for _ in range(args.repeats):
        dt, outs = timed(llm, items, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = 0
        for o in outs:
            try:
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        runs = {"json_schema": (dt, sum(lengths))}
        same = [SamplingParams(max_tokens=n, temperature=args.temperature, seed=1, ignore_eos=True)
                for n in lengths]
        dt, outs = timed(llm, items, same)
        runs["unconstrained_same_lengths"] = (dt, sum(len(o.outputs[0].token_ids) for o in outs))
        free = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1)
        dt, outs = timed(llm, items, free)
        runs["unconstrained"] = (dt, sum(len(o.outputs[0].token_ids) for o in outs))
        ratios.append((runs["json_schema"][1] / runs["json_schema"][0])
                      / (runs["unconstrained_same_lengths"][1] / runs["unconstrained_same_lengths"][0]))
        for name, (dt, tokens) in runs.items():
            tps = tokens / dt
            if name not in best or tps > best[name]["gen_tok_s"]:
                best[name] = {"seconds": round(dt, 3), "gen_tokens": tokens, "gen_tok_s": round(tps, 1)}
    result = {"model": args.model, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "compact": args.compact, "runs": best,
              "valid_json": f"{valid}/{args.num_prompts}",
              "ratio_vs_same_lengths": round(statistics.median(ratios), 3),
              "ratios_per_repeat": [round(r, 3) for r in ratios], "target": 0.85}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0 if valid == args.num_prompts else 1


if __name__ == "__main__":
    sys.exit(main())
