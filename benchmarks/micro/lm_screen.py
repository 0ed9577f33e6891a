"""The fp32 lm_head's bf16 screen on real rows: `python -m benchmarks.micro.lm_screen [--prompts 24] [--tokens 96]`.

Generates greedy replies to the chat workload's first prompts with transformers (SmolLM2-135M-Instruct, fp32) and
keeps the final hidden state of every row that chose a token. On those rows it prints how many outputs the screen's
error bound leaves a row (the bound as csrc/logits.c's greedy_f32_screened states it: (2u + u^2 + 2.2 k 2^-24) ||x||
||w_j|| plus the bf16 output's rounding, u = 2^-9), the largest actual error over its bound, and greedy_f32 against
greedy_f32_screened by row count (best of 5, each the same tokens)."""

from __future__ import annotations

import time

import batchrun  # noqa: F401 - OpenMP settings before torch

# isort: split
import torch

from benchmarks.harness.chat import QUESTIONS
from benchmarks.harness.cli_args import parser

U = 2.0**-9


def hidden_rows(prompts: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each decode row's final hidden state [rows, hidden], the lm_head's weight [vocab, hidden]), fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchrun.model.weights.builtin import builtin_path

    path = builtin_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = []
    for question in QUESTIONS[:prompts]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, output_hidden_states=True,
                             return_dict_in_generate=True)
        rows += [step[-1][0, -1] for step in out.hidden_states]  # the prompt's last row, then each new one
    return torch.stack(rows), model.lm_head.weight.detach()


def bound_report(x: torch.Tensor, weight: torch.Tensor) -> str:
    k = weight.shape[1]
    exact = (x.double() @ weight.double().T)
    screened = (x.bfloat16().double() @ weight.bfloat16().double().T).float().bfloat16().double()
    slope = (2 * U + U * U + 2.2 * k * 2.0**-24) * x.double().norm(dim=1, keepdim=True)
    bound = slope * weight.double().norm(dim=1) + screened.abs() / 510
    floor = (screened - bound).max(dim=1, keepdim=True).values
    kept = (screened + bound >= floor).sum(dim=1).float()
    return (f"{x.shape[0]} rows: outputs the bound leaves a row: mean {kept.mean():.2f}, median {kept.median():.0f}, "
            f"max {kept.max():.0f}; largest error / bound {((screened - exact).abs() / bound).max():.3f}")


def timings(x: torch.Tensor, weight: torch.Tensor, row_counts: list[int]) -> list[str]:
    from batchrun.kernels.cpu import linears, logits

    n, k = weight.shape
    packed = linears.pack_linear(weight.contiguous())
    screen = logits.lm_screen(packed, n, k)
    calls = {"greedy_f32": lambda h: logits.greedy_f32(h, packed, n),
             "greedy_f32_screened": lambda h: logits.greedy_f32_screened(h, screen, packed, n)}
    lines = []
    for rows in row_counts:
        h = x[torch.arange(rows) % x.shape[0]].contiguous()
        assert torch.equal(calls["greedy_f32"](h), calls["greedy_f32_screened"](h))
        best = {}
        for name, call in calls.items():
            call(h)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                call(h)
                times.append(time.perf_counter() - start)
            best[name] = min(times) * 1e3
        lines.append(f"{rows:4d} rows: greedy_f32 {best['greedy_f32']:7.2f} ms, greedy_f32_screened "
                     f"{best['greedy_f32_screened']:7.2f} ms, {best['greedy_f32'] / best['greedy_f32_screened']:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=24, help="chat prompts to reply to")
    ap.add_argument("--tokens", type=int, default=96, help="tokens each reply")
    ap.add_argument("--rows", default="1,4,16,66,256", help="comma-separated row counts to time")
    args = ap.parse_args(argv)
    x, weight = hidden_rows(args.prompts, args.tokens)
    print(bound_report(x, weight))
    for line in timings(x, weight, [int(r) for r in args.rows.split(",")]):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
