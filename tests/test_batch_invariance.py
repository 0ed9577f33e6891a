"""Batch invariance: a request's tokens are a function of its own prompt, parameters and seed,
never of the batch it ran in.

The property test runs a few target requests alone (one sequence at a time, no prefix cache), then among
random other requests under random engine limits: `max_num_seqs` 1..64, `max_num_batched_tokens` small
enough to chunk prefills, prefix caching on and off (some others share a target's prefix), and a KV pool
small enough to force swap and recompute preemptions. Every target's tokens must be the same, greedy and
seeded temperature 0.8 (with and without top_p), in float32 and bfloat16. Below it, the per-op facts it rests
on: the linears, the bf16 logits refinement and the sampler give each row the bits it gets alone. All on the CPU,
where the promise holds (on CUDA the linears are cuBLAS's: docs/reproducibility-kernels.md; the Triton attention's
part of it is tests/test_batch_invariance_triton.py).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import attention as cpu_attention
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import OneDNNLinear, PackedLinear

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# bf16 models have invariant linears through batchrun's bf16 panels (layers/linear.py: own_kernel): oneDNN's bf16 kernels
# change with the row count
BF16_MODEL = cpu_linears.has_panel_linears()

MAX_TOKENS = 8
# The targets also return their chosen tokens' log-probs, compared bitwise: a function of the logits, so a
# difference in the last bit of any logit shows even where it moves no token.
TARGET_PARAMS = [
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=11, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=12, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """The targets: lengths 5, 21 (past a 16-token block), 40 and 57; the last two share a 33-token prefix
    (two full blocks that a prefix cache can hand from one to the other)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(33)]
    return [[rng.randrange(3, vocab) for _ in range(5)], [rng.randrange(3, vocab) for _ in range(21)],
            shared + [rng.randrange(3, vocab) for _ in range(7)], shared + [rng.randrange(3, vocab) for _ in range(24)]]


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Each request's (tokens, log-probs of its chosen tokens or None)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


# (name, engine settings, seed of the others); num_kv_blocks of 16 tokens. Requests arrive in random order,
# but for two cases. In "prefix-cache" the target with the 33-token shared prefix comes first and the one
# sharing it last, so that it reuses two cached blocks. In the preemption cases six others of 15 or 31 tokens
# arrive first and need a new block at their first decode step, on a 14-block pool: the group that arrived
# last, a target, is preempted.
SCENARIOS = [
    ("two", dict(max_num_seqs=2), 0),
    ("many", dict(max_num_seqs=64), 1),
    ("three-no-prefix-cache", dict(max_num_seqs=3, enable_prefix_caching=False), 2),
    ("prefix-cache", dict(max_num_seqs=5, enable_prefix_caching=True), 3),
    ("chunked", dict(max_num_seqs=16, max_num_batched_tokens=24, enable_prefix_caching=False), 4),
    ("chunked-prefix-cache", dict(max_num_seqs=7, max_num_batched_tokens=40), 5),
    ("swap", dict(max_num_seqs=12, num_kv_blocks=14, swap_space=2**20, preemption_mode="swap",
                  enable_prefix_caching=False), 6),
    ("recompute", dict(max_num_seqs=12, num_kv_blocks=14, preemption_mode="recompute", enable_prefix_caching=False),
     7),
]
SCENARIO_IDS = ["two", "many", "three-no-prefix-cache", "prefix-cache", "chunked", "chunked-prefix-cache", "swap",
                "recompute"]


@pytest.fixture(scope="module")
def references(make_ckpt):
    """Per dtype: the model path, the targets and their tokens run alone."""
    path = make_ckpt("llama")
    refs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(path), dtype=dtype, device="cpu", batch_invariant=True, max_num_seqs=1,
                  enable_prefix_caching=False, num_kv_blocks=64)
        prompts = _prompts(llm.config.vocab_size)
        refs[dtype] = (prompts, [_generate(llm, [p], [sp])[0] for p, sp in zip(prompts, TARGET_PARAMS)])
    return path, refs


def _others(rng: random.Random, targets: list[list[int]], vocab: int,
            preempting: bool = False) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for _ in range(6 if preempting else rng.randrange(3, 10)):
        if preempting:  # one token short of a block: a new block at the first decode step
            prompt = [rng.randrange(3, vocab) for _ in range(rng.choice([15, 31]))]
        elif rng.random() < 0.3:  # shares a target's first blocks: a prefix-cache hit for whoever comes second
            base = rng.choice(targets[2:])
            prompt = base[: rng.randrange(16, len(base))] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))]
        else:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
        prompts.append(prompt)
        max_tokens = MAX_TOKENS if preempting else rng.randrange(1, MAX_TOKENS + 1)
        params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                     temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.95, 0.5]),
                                     top_k=rng.choice([0, 0, 5]), seed=rng.randrange(1000)))
    return prompts, params


@onednn
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not BF16_MODEL, reason="no batch-invariant bf16 linears here (no oneDNN bf16 kernels, no C kernels)"))])
@pytest.mark.parametrize(("name", "settings", "seed"), SCENARIOS, ids=SCENARIO_IDS)
def test_tokens_do_not_depend_on_the_batch(references, dtype, name, settings, seed):
    path, refs = references
    targets, expected = refs[dtype]
    llm = LLM(str(path), dtype=dtype, device="cpu", batch_invariant=True, **{"num_kv_blocks": 64, **settings})
    rng = random.Random(seed)
    preempting = "num_kv_blocks" in settings
    others, other_params = _others(rng, targets, llm.config.vocab_size, preempting)
    order = [*range(len(targets), len(targets) + len(others)), *range(len(targets))]
    if name == "prefix-cache":
        order = [2, *order[:-4], 0, 1, 3]
    elif not preempting:
        rng.shuffle(order)
    prompts, params = targets + others, TARGET_PARAMS + other_params
    got = _generate(llm, [prompts[i] for i in order], [params[i] for i in order])
    by_index = dict(zip(order, got))
    assert [by_index[i] for i in range(len(targets))] == expected
    metrics = llm.metrics()
    if name == "swap":
        assert metrics["num_preemptions_swap"] > 0
    if name == "recompute":
        assert metrics["num_preemptions_recompute"] > 0
    if name == "prefix-cache":
        assert metrics["prefix_cache_hit_tokens"] >= 32


# ---- the per-op facts ---------------------------------------------------------------------------------------

# Row counts of one call: every count up to 18 (row tiles of 8 and 16, a step's decode rows), tile edges past them
# and prefill sizes up to 300 rows; the small ones also taken at an offset, so that a row sits elsewhere in its tile.
ROW_COUNTS = (*range(1, 19), 24, 31, 32, 33, 47, 64, 65, 129, 257, 300)


def _invariant_linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
    """The module the batch-invariant mode puts in a model's place of nn.Linear(in, out) (model/layers/linear.py)."""
    from batchrun.model.layers.linear import reorder_linears, use_onednn

    torch.manual_seed(in_features + out_features)
    model = nn.Module()
    model.proj = nn.Linear(in_features, out_features, bias=False).to(dtype)
    weight = model.proj.weight.detach().clone()
    assert use_onednn(model, torch.device("cpu"), dtype, batch_invariant=True)
    reorder_linears(model, batch_invariant=True)
    model.proj.reference_weight = weight
    return model.proj


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_MODEL, reason="no batch-invariant bf16 linears here (no oneDNN bf16 kernels, no C kernels)"))],
    ids=["fp32", "bf16"])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 2048), (576, 960), (1536, 576), (2048, 200)])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(dtype, in_features, out_features):
    """Each row of the mode's linear equals that row computed alone, at every row count from 1 to 300 and at any
    place in the call (K = 1536: fp32 oneDNN has another kernel for 1 row; bf16 oneDNN changes kernels with the row
    count, so bf16 takes batchrun's panels, which on a CPU with AMX run on AMX tiles)."""
    layer = _invariant_linear(in_features, out_features, dtype)
    if dtype == torch.bfloat16:
        assert isinstance(layer, PackedLinear)
    x = torch.randn(max(ROW_COUNTS) + 5, in_features).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in ROW_COUNTS:
        for start in (0, 5) if rows < 40 else (3,):
            assert torch.equal(layer(x[start : start + rows]), alone[start : start + rows]), (rows, start)
    torch.testing.assert_close(alone.float(), F.linear(x, layer.reference_weight).float(), atol=0.05, rtol=0.02)


@onednn
@pytest.mark.skipif(not BF16_MODEL, reason="no batch-invariant bf16 linears here (no oneDNN bf16 kernels, no C kernels)")
def test_invariant_bf16_lm_head_rows_do_not_depend_on_the_row_count():
    """A SmolLM2-sized lm_head (vocab 49152 x 576), the largest linear of a small model's step."""
    layer = _invariant_linear(576, 49152, torch.bfloat16)
    x = torch.randn(70, 576).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for rows, start in ((2, 0), (3, 1), (9, 4), (17, 0), (33, 7), (64, 3), (70, 0)):
        assert torch.equal(layer(x[start : start + rows]), alone[start : start + rows]), (rows, start)


def test_refine_top_logits_one_row_as_in_a_batch():
    from batchrun.model.arch.blocks import refine_top_logits

    torch.manual_seed(0)
    weight = torch.randn(4096, 1536).bfloat16()
    hidden_states = torch.randn(300, 1536).bfloat16()
    top = torch.randint(0, 4096, (300, 8))

    def refined(lo: int, hi: int) -> torch.Tensor:
        logits = torch.zeros(hi - lo, 4096)
        refine_top_logits(logits, hidden_states[lo:hi], weight, top[lo:hi])
        return logits.gather(1, top[lo:hi])

    alone = torch.cat([refined(i, i + 1) for i in range(300)])
    for rows in (2, 3, 4, 7, 8, 9, 16, 17, 33, 64, 65, 257, 300):
        start = 300 - rows if rows % 2 else 0
        assert torch.equal(refined(start, start + rows), alone[start : start + rows]), rows


def test_sampler_rows_do_not_depend_on_the_batch():
    """Every row's draw in a mixed batch (greedy, temperatures, top-k, top-p, min-p, penalties, logprobs) is
    the draw it makes alone, over many steps."""
    from batchrun.engine.contract import SamplingRequest
    from batchrun.model.sampling.step import plan_sampling, sample_step

    rng = random.Random(0)
    vocab = 4096
    requests = []
    for i in range(24):
        params = SamplingParams(temperature=rng.choice([0.0, 0.5, 0.8, 1.3]), top_p=rng.choice([1.0, 0.9, 0.3]),
                                top_k=rng.choice([0, 0, 20]), min_p=rng.choice([0.0, 0.0, 0.05]),
                                repetition_penalty=rng.choice([1.0, 1.0, 1.2]), logprobs=rng.choice([None, 3]))
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(2, 30))]
        requests.append(SamplingRequest(params=params, seeds=[1000 + i], num_output=rng.randrange(0, 5),
                                        token_ids=tokens, prompt_len=len(tokens) - 1))
    for step in range(8):
        logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(step)) * 4
        batch = sample_step(logits, plan_sampling(requests, vocab, logits.device))
        for i, r in enumerate(requests):
            alone = sample_step(logits[i : i + 1], plan_sampling([r], vocab, logits.device))
            assert alone.token_ids == batch.token_ids[i : i + 1], (step, i)
            if r.params.logprobs is not None:  # the batch computes every row's when one row asks
                assert alone.logprobs == batch.logprobs[i : i + 1]
                assert alone.top_token_ids == [batch.top_token_ids[i]]
                assert alone.top_logprobs == [batch.top_logprobs[i]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch"])
def test_norm_silu_rope_rows_do_not_depend_on_the_row_count(dtype, kernels):
    """RMSNorm (with its residual add), SiLU-and-multiply and RoPE give each row the bits it gets alone."""
    from batchrun.model.layers.ops import CpuKernelOps, Rotary, TorchOps

    if kernels and not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    ops = CpuKernelOps() if kernels else TorchOps()
    gen = torch.Generator().manual_seed(0)
    rows, hidden, heads, head_dim = 67, 576, 3, 64
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen).to(dtype)
    qk = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (rows,), generator=gen)
    angles = torch.arange(512)[:, None] * torch.rand(head_dim // 2, generator=gen)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def run(lo: int, hi: int) -> list[torch.Tensor]:
        res = residual[lo:hi].clone()
        normed, added = ops.rms_norm(x[lo:hi].clone(), weight, 1e-5, res)
        q, k = qk[lo:hi].clone(), qk[lo:hi].clone()[:, :1].contiguous()
        q, k = ops.apply_rope(q, k, Rotary(positions[lo:hi], cos, sin, dtype))
        return [ops.rms_norm(x[lo:hi].clone(), weight, 1e-5), normed, added, ops.silu_mul(gate_up[lo:hi].clone()), q, k]

    whole = run(0, rows)
    for lo, hi in ((0, 1), (5, 6), (3, 20), (33, 67)):
        for got, ref in zip(run(lo, hi), whole):
            assert torch.equal(got, ref[lo:hi]), (lo, hi)


def test_c_decode_attention_rows_do_not_depend_on_the_batch():
    """The C decode kernel gives a sequence the same bits alone and beside longer and shorter contexts."""
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, kv_heads, heads, head_dim = 16, 40, 2, 6, 64
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(4, 10)
    lens = torch.tensor([150, 3, 77, 160], dtype=torch.int32)
    q = torch.randn(4, heads, head_dim, generator=gen)
    one_row = torch.zeros(1, dtype=torch.int32)
    whole = cpu_attention.paged_attention(q, cache, tables, torch.arange(4, dtype=torch.int32), lens, 0.125)
    for i in range(4):
        alone = cpu_attention.paged_attention(q[i : i + 1], cache, tables[i : i + 1], one_row, lens[i : i + 1], 0.125)
        assert torch.equal(alone, whole[i : i + 1]), i


def test_the_mode_defaults_on_in_float32_on_a_cpu(make_ckpt, caplog):
    from batchrun.model.layers.backends import resolve_batch_invariant

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_batch_invariant(None, cpu, torch.float32) is True
    assert resolve_batch_invariant(None, cpu, torch.bfloat16) is False
    assert resolve_batch_invariant(None, cuda, torch.float32) is False
    assert resolve_batch_invariant(False, cpu, torch.float32) is False
    assert resolve_batch_invariant(True, cuda, torch.bfloat16) is True
    assert "linears are cuBLAS's" in caplog.text

    path = str(make_ckpt("llama"))
    llm = LLM(path, device="cpu", num_kv_blocks=16)
    model = llm.engine.runner.model
    assert llm.batch_invariant
    for layer in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj, model.lm_head):
        if cpu_linears.has_panel_linears():  # batchrun's kernel: one chain per output whatever the row count
            assert isinstance(layer, PackedLinear)
        elif torch.backends.mkldnn.is_available():
            assert isinstance(layer, OneDNNLinear) and (layer.min_rows, layer.max_rows) == (2, None)
    off = LLM(path, device="cpu", num_kv_blocks=16, batch_invariant=False)
    assert not off.batch_invariant and type(off.engine.runner.model.lm_head) is nn.Linear  # small: MKL
