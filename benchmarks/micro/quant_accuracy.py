"""Accuracy of the quantized linears: `python -m benchmarks.micro.quant_accuracy [--model M] [--formats ...]`.

For each format (none = the model in bf16, int8, int4, int4-g32: EngineArgs.quantization; a `+head` suffix, e.g.
int8+head, adds EngineArgs.quantize_lm_head), on the same model in bf16 activations:
  - top-1 agreement with the bf16 model: the bf16 model's greedy replies to chat questions (plain prompts where
    the tokenizer has no chat template), fed back one token per decode step through the quantized model
    (teacher forcing), and the share of positions where its argmax is the bf16 model's token;
  - perplexity on a fixed paragraph (benchmarks/micro/data/quant_text.txt), teacher-forced the same way.
With --openvino, OpenVINO's own quantized exports (nncf's data-free weight compression) are scored the same way
against the same bf16 replies, each prompt and reply in one forward (benchmarks.peers.openvino.accuracy).
The default model is the built-in SmolLM2-135M-Instruct; --model PATH takes any checkpoint (the lead's
random-weight 1B model: its replies are noise, but agreement still says how far the quantized logits move).
Targets: int8 >= 97%, int4 >= 90% agreement. tests/test_quant_accuracy.py holds the built-in model's
figures to them on a shorter run.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import torch

from batchrun import LLM, SamplingParams
from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
from batchrun.model.weights.builtin import builtin_path
from benchmarks.harness.cli_args import parser
from benchmarks.peers.openvino import env as openvino_env

TEXT = Path(__file__).resolve().parent / "data" / "quant_text.txt"
QUESTIONS = ["What is the tallest mountain in the world?", "Name three colours of the rainbow.",
             "How do I make a cup of tea?", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
             "What is 7 plus 5?", "Why do we have seasons?", "Suggest a name for a pet goldfish."]
BLOCK = 16


def teacher_forced(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]
                   ) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt prefilled, then its continuation fed back one token per decode step (all sequences in one
    step): (argmax at each continuation position, log-probability of the continuation's token there)."""
    runner = llm.engine.runner
    blocks = max(-(-(len(p) + len(c)) // BLOCK) for p, c in zip(prompts, continuations))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    top1: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]

    def take(rows: list[int], logits: torch.Tensor, step: int) -> None:
        lp = torch.log_softmax(logits.float(), dim=-1)
        for row, i in enumerate(rows):
            top1[i].append(int(lp[row].argmax()))
            logprobs[i].append(float(lp[row, continuations[i][step]]))

    logits = runner.compute_logits(SchedulerOutput(
        seqs=[ScheduledSeq(i, p, 0, tables[i], True) for i, p in enumerate(prompts)], num_decodes=0))
    take(list(range(len(prompts))), logits, 0)
    for step in range(1, max(len(c) for c in continuations)):
        live = [i for i, c in enumerate(continuations) if step < len(c)]
        seqs = [ScheduledSeq(i, [continuations[i][step - 1]], len(prompts[i]) + step - 1, tables[i], True)
                for i in live]
        take(live, runner.compute_logits(SchedulerOutput(seqs=seqs, num_decodes=len(seqs))), step)
    return top1, logprobs


def chat_prompts(tokenizer) -> list[list[int]]:
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q in QUESTIONS]
        return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    return [tokenizer(q).input_ids for q in QUESTIONS]


def greedy_replies(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    pairs = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    return sum(a == b for a, b in pairs) / len(pairs)


def perplexity(llm: LLM, text: str) -> float:
    ids = llm.tokenizer(text).input_ids
    _, logprobs = teacher_forced(llm, [ids[:1]], [ids[1:]])
    return perplexity_of(logprobs[0])


def perplexity_of(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def make_llm(model: str, fmt: str, threads: int | None) -> LLM:
    """fmt: a quantization value, with `+head` for the lm_head in int8 too (EngineArgs.quantize_lm_head) and
    `+gptq` for GPTQ over the built-in calibration text (EngineArgs.calibration), e.g. `int4+gptq+head`."""
    quantization, *flags = fmt.split("+")
    return LLM(model, dtype="bfloat16", device="cpu", kv_cache_memory="256MiB", block_size=BLOCK,
               quantization=quantization, quantize_lm_head="head" in flags,
               calibration="builtin" if "gptq" in flags else "none", num_threads=threads)


def main() -> None:
    ap = parser(__doc__, model="builtin:smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all this process may use)")
    ap.add_argument("--formats", default="none,int8,int4,int4-g32",
                    help="comma-separated; FORMAT+head: the lm_head in int8 too, FORMAT+gptq: GPTQ over the built-in "
                         "calibration text (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64, help="reply tokens per question (default %(default)s)")
    ap.add_argument("--openvino", default="",
                    help="comma-separated OpenVINO export formats (benchmarks.peers.openvino.env.WEIGHT_OPTIONS, e.g. "
                         "int4-sym-g64) scored the same way beside batchrun's, bf16 inference precision; needs "
                         "OpenVINO's venv (python -m benchmarks.peers.openvino.env)")
    args = ap.parse_args()
    text = TEXT.read_text()
    reference = make_llm(args.model, "none", args.threads)
    prompts = chat_prompts(reference.tokenizer)
    replies = greedy_replies(reference, prompts, args.tokens)
    text_ids = reference.tokenizer(text).input_ids
    del reference
    gc.collect()
    print(f"{args.model}: {len(prompts)} replies x {args.tokens} tokens against bf16; perplexity on {TEXT.name}")
    print(f"{'format':>24}  {'top-1 agreement':>16}  {'perplexity':>10}")
    for fmt in args.formats.split(","):
        llm = make_llm(args.model, fmt, args.threads)
        top1, _ = teacher_forced(llm, prompts, replies)
        print(f"{fmt:>24}  {agreement(top1, replies):>16.2%}  {perplexity(llm, text):>10.3f}")
        del llm
        gc.collect()
    for fmt in filter(None, args.openvino.split(",")):
        checkpoint = args.model
        if checkpoint.startswith("builtin:"):
            checkpoint = str(builtin_path(checkpoint.removeprefix("builtin:")))
        try:  # one worker: the replies, then the paragraph
            top1, logprobs = openvino_env.teacher_forced(checkpoint, fmt, [*zip(prompts, replies),
                                                                           (text_ids[:1], text_ids[1:])],
                                                         threads=args.threads or 2)
        except (RuntimeError, ValueError) as e:
            print(f"openvino:{fmt}: {e}")
            continue
        print(f"{'openvino:' + fmt:>24}  {agreement(top1[:-1], replies):>16.2%}  {perplexity_of(logprobs[-1]):>10.3f}")


if __name__ == "__main__":
    main()
