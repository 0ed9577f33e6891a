"""Batch invariance on a model whose shapes reach every kernel path: a Qwen2-shaped model of SmolLM2's
widths (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64 dims, a tied 49152-token vocabulary, q/k/v
biases), 2 layers.

The tiny test models of test_batch_invariance.py (hidden 64) keep every linear in cache and every K short: the
kernels that change with the row count (oneDNN's bf16 kernels past a few rows, its fp32 one-row kernel for
K >= 1536, AMX tiles, the k-blocked panels) are never reached there. Here ten requests run alone, then among 60
others under each of these settings: few sequences a step, many with small token budgets (chunked prefills), no
prefix cache, drafts off, swap and recompute preemption. Steps then hold from 1 to well over 300 rows. Every
target's tokens and chosen log-probs must be the ones it gets alone, greedy and seeded temperature 0.8. On the
CPU (device="cpu" even where there is a GPU): batch invariance is promised there (docs/reproducibility.md), not
for cuBLAS's linears.
"""

from __future__ import annotations

import random

import pytest
import torch
from draft_helpers import FreeRows

from batchrun import LLM, SamplingParams
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import PackedLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
BF16_MODEL = cpu_linears.has_panel_linears()  # bf16's invariant linears are batchrun's panels

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, max_position_embeddings=1024)
MAX_TOKENS = 10
NUM_OTHERS = 60


def _target_params() -> list[SamplingParams]:
    """Greedy and seeded temperature 0.8, alternating. Two greedy ones also return their chosen tokens' log-probs
    (compared bitwise, so a difference in the last bit of a logit shows where it moves no token); the other three
    do not, so that they take drafts (a row asking for log-probs has none)."""
    greedy = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0 if i < 2 else None)
              for i in range(5)]
    seeded = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=(1.0, 0.9)[i % 2], seed=100 + i,
                             ignore_eos=True, logprobs=0) for i in range(5)]
    return [p for pair in zip(greedy, seeded) for p in pair]


def _target_prompts(vocab: int) -> list[list[int]]:
    """Ten prompts of 3 to 150 tokens; the greedy ones repeat a phrase, so that their drafters find matches."""
    rng = random.Random(0)
    prompts = []
    for i, length in enumerate((3, 150, 17, 40, 64, 9, 33, 100, 21, 70)):
        if i % 2 == 0:
            phrase = [rng.randrange(3, vocab) for _ in range(5)]
            prompts.append((phrase * (length // 5 + 1))[:length])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def wide_model(make_ckpt):
    # init_std 0.03: some greedy rows fall into loops, whose drafts the engine then checks and keeps
    return make_ckpt("qwen2", init_std=0.03, **SHAPE)


@pytest.fixture(scope="module")
def alone(wide_model):
    """Per dtype: the targets' outputs, each request run by itself (no prefix cache, no drafts)."""
    refs = {}
    for dtype in ("bfloat16", "float32"):
        if dtype == "bfloat16" and not BF16_MODEL:
            continue
        llm = LLM(str(wide_model), dtype=dtype, device="cpu", batch_invariant=True, max_num_seqs=1,
                  enable_prefix_caching=False, num_speculative_tokens=0, num_kv_blocks=64)
        if dtype == "bfloat16":  # every linear on the one kernel, the tied lm_head's packed copy too
            model = llm.engine.runner.model
            assert isinstance(model.lm_head, PackedLinear) and isinstance(model.layers[0].mlp.down_proj, PackedLinear)
        prompts, params = _target_prompts(llm.config.vocab_size), _target_params()
        refs[dtype] = (prompts, params, [_generate(llm, [p], [sp])[0] for p, sp in zip(prompts, params)])
    return refs


def _others(rng: random.Random, targets: list[list[int]], vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for _ in range(NUM_OTHERS):
        if rng.random() < 0.2:  # shares a target's first blocks: a prefix-cache hit for whoever comes second
            base = rng.choice([t for t in targets if len(t) > 20])
            prompt = base[: rng.randrange(16, len(base))] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 100))]
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=rng.randrange(1, MAX_TOKENS + 1), ignore_eos=True,
                                     temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.95]),
                                     seed=rng.randrange(1000)))
    return prompts, params


# (name, engine settings): few sequences a step, small steps, and the rest of the paths a row can take
SETTINGS = {
    "few-seqs": dict(max_num_seqs=7, num_speculative_tokens=8),
    "small-steps": dict(max_num_seqs=64, max_num_batched_tokens=96, num_speculative_tokens=8),
    "no-prefix-cache-no-drafts": dict(max_num_seqs=32, enable_prefix_caching=False, num_speculative_tokens=0),
    "swap": dict(max_num_seqs=24, num_kv_blocks=40, swap_space=64 * 2**20, preemption_mode="swap",
                 enable_prefix_caching=False),
    "recompute": dict(max_num_seqs=24, num_kv_blocks=40, preemption_mode="recompute"),
}

# the widest step each setting must reach (rows of one forward), where its limits keep it under 300
WIDEST_STEP = {"few-seqs": 150, "small-steps": 90, "swap": 100, "recompute": 100}


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.skipif(
    not BF16_MODEL, reason="no batch-invariant bf16 linears here (batchrun's C kernels are not built)")), "float32"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_rows_tokens_do_not_depend_on_its_batch(wide_model, alone, dtype, name):
    if dtype == "float32" and name != "small-steps":
        pytest.skip("float32 runs one of the settings here (all of them on the tiny models, test_batch_invariance.py)")
    prompts, params, expected = alone[dtype]
    settings = {"num_kv_blocks": 256, **SETTINGS[name]}
    llm = LLM(str(wide_model), dtype=dtype, device="cpu", batch_invariant=True, **settings)
    llm.engine.scheduler.step_costs = FreeRows()  # the policy checks every draft, whatever this machine's timings
    step_rows = []  # rows (tokens) of each step's forward (decode steps planned on the host call no module)
    execute = llm.engine.runner.execute

    def counted(out):
        if out.seqs:
            step_rows.append(sum(len(s.token_ids) for s in out.seqs))
        return execute(out)

    llm.engine.runner.execute = counted
    rng = random.Random(name)
    others, other_params = _others(rng, prompts, llm.config.vocab_size)
    everything, all_params = prompts + others, params + other_params
    order = list(range(len(everything)))
    rng.shuffle(order)
    got = dict(zip(order, _generate(llm, [everything[i] for i in order], [all_params[i] for i in order])))
    for i, want in enumerate(expected):
        assert got[i] == want, (name, i)
    assert min(step_rows) <= 8 and max(step_rows) > WIDEST_STEP.get(name, 300), sorted(set(step_rows))
    metrics = llm.metrics()
    if name in ("few-seqs", "small-steps"):
        assert metrics["draft_tokens"] > 0  # drafts were checked beside the other rows
    if name == "swap":
        assert metrics["num_preemptions_swap"] > 0
    if name == "recompute":
        assert metrics["num_preemptions_recompute"] > 0
