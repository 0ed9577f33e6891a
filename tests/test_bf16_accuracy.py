"""bf16 on the CPU (oneDNN bf16 linears and the few-row bf16 linear kernel, or batchrun's bf16 panels for every
linear where oneDNN has no bf16 kernels; the bf16 C kernels, a bf16 KV cache, an fp32 residual stream) against
the fp32 transformers model on the real SmolLM2-135M-Instruct weights: teacher-forced top-1 agreement over 1,024
positions.

Greedy continuations (fp32, by batchrun, which is token-identical to transformers: test_real_model.py) are
fed back one token per decode step through batchrun's bf16 runner, so every position runs the bf16 paged
decode attention, KV store, RoPE, RMSNorm and SiLU kernels; the fp32 reference is transformers' own forward
over the same tokens. transformers' own bf16 forward scores about 98.4% on such a test, so >= 98% says the
bf16 path loses nothing beyond bf16 itself.
"""

import pytest
import torch
from test_real_model import QUESTIONS, TEXTS, chat_text

from batchrun import LLM, SamplingParams
from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import PackedLinear

NEW_TOKENS = 64  # x 16 prompts = 1,024 positions
BLOCK = 16


def _bf16_top1(llm: LLM, prompts: list[list[int]], continuations: list[list[int]], group: int) -> list[list[int]]:
    """bf16 argmax at every continuation position: the prompts prefilled in one step, then each
    continuation token fed back as decode steps of `group` sequences each."""
    runner = llm.engine.runner
    blocks = max(-(-(len(p) + len(c)) // BLOCK) for p, c in zip(prompts, continuations))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    logits = runner.compute_logits(SchedulerOutput(
        seqs=[ScheduledSeq(i, p, 0, tables[i], True) for i, p in enumerate(prompts)], num_decodes=0))
    top1 = [[t] for t in logits.argmax(-1).tolist()]
    for step in range(1, NEW_TOKENS):
        seqs = [ScheduledSeq(i, [c[step - 1]], len(p) + step - 1, tables[i], True)
                for i, (p, c) in enumerate(zip(prompts, continuations))]
        for first in range(0, len(seqs), group):
            part = seqs[first : first + group]
            for row, t in zip(top1[first:], runner.compute_logits(SchedulerOutput(seqs=part, num_decodes=len(part)))
                              .argmax(-1).tolist()):
                row.append(t)
    return top1


@pytest.mark.slow
def test_bf16_top1_agreement_with_fp32_transformers(smollm2, smollm2_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    tok = smollm2.tokenizer
    prompts = [tok(chat_text(tok, q), add_special_tokens=False).input_ids for q in QUESTIONS]
    prompts += [tok(t).input_ids for t in TEXTS]
    outs = smollm2.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    continuations = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(c) == NEW_TOKENS for c in continuations)

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()
    ref = []
    with torch.inference_mode():
        for p, c in zip(prompts, continuations):
            logits = hf(torch.tensor([p + c[:-1]])).logits[0]
            ref.append(logits[len(p) - 1:].argmax(-1).tolist())
    del hf

    bf16 = LLM(str(smollm2_path), dtype="bfloat16", device="cpu", kv_cache_memory="64MiB", block_size=BLOCK)
    runner = bf16.engine.runner
    assert runner.kv_cache.dtype == torch.bfloat16 and runner.ops.name == "cpu_kernels"
    assert runner.backend.cpu_kernels
    positions = sum(len(r) for r in ref)
    assert positions >= 1000
    # all 16 sequences per decode step through oneDNN's linears (the few-row kernel's limit lowered below 16
    # for it), then 16 and 4 through the few-row kernel (cpu_linears.SMALL_ROWS; on the fp32 panels two row tiles
    # and one, on AMX one 16-row tile). Where oneDNN has no bf16 kernels every linear is on the panels
    # (PackedLinear), which give a row the same bits in any group: one pass says it all.
    assert cpu_linears.SMALL_ROWS >= len(prompts)
    ways = ((len(prompts), len(prompts) // 2), (len(prompts), cpu_linears.SMALL_ROWS), (4, cpu_linears.SMALL_ROWS))
    if isinstance(runner.model.layers[0].mlp.down_proj, PackedLinear):
        ways = ways[1:2]
    for group, small_rows in ways:
        monkeypatch.setattr(cpu_linears, "SMALL_ROWS", small_rows)
        got = _bf16_top1(bf16, prompts, continuations, group)
        agree = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
        print(f"bf16 top-1 agreement, {group} sequences per decode step, few-row kernel up to {small_rows} rows: "
              f"{agree}/{positions}")
        assert agree / positions >= 0.98, f"bf16 top-1 agreement {agree}/{positions} = {agree / positions:.2%}"
