"""Every model family against transformers on tiny random checkpoints of odd shapes (conftest.ARCH_SPECS: GQA
ratios 1 to 6, head dims 16 to 48, windows shorter than the prompts, each family's switches away from their
defaults). The families and what each one is verified for are batchrun/model/arch/registry.py's: every test here is
parametrized over `families_verifying(check)`, so a claim there is a test here (test_models_registry.py holds
the two together).

- greedy: fp32 greedy tokens equal transformers' generate, token for token (the C kernels' CPU path);
- logits: fp32 prefill logits through the paged cache within 1e-4 of transformers' forward;
- bf16: teacher-forced top-1 agreement of the bf16 model with the fp32 one >= 98%;
- invariant / seeded: greedy and seeded sampled rows give the same tokens (and log-probs, bitwise) alone and in
  a crowded batch with chunked prefill and prefix caching;
- triton: greedy tokens equal transformers' through the Triton kernels (on CUDA where there is a GPU, else
  interpreted on the CPU).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import LLM, SamplingParams
from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
from batchrun.model.arch.registry import families_verifying

# (family) -> (make_ckpt arch, overrides): a family's tiny checkpoint. Mistral's has a sliding window shorter
# than most prompts (the llama family's other members are test_parity.py's too).
CHECKPOINTS = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": 28}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
}
LENGTHS = [1, 6, 17, 30, 64, 101, 150]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def checkpoint(make_ckpt, family: str):
    arch, overrides = CHECKPOINTS[family]
    return make_ckpt(arch, **overrides)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in LENGTHS]


_HF: dict = {}


def hf_model(path):
    if path not in _HF:
        _HF.clear()  # one at a time: the module holds at most one reference model
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_greedy(path, prompts, new_tokens=NEW_TOKENS):
    hf = hf_model(path)
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


def generate(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", families_verifying("greedy"))
def test_greedy_equals_transformers(make_ckpt, prompts, family):
    path = checkpoint(make_ckpt, family)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=200)
    assert llm.engine.runner.backend.cpu_kernels == llm.engine.runner.ops.name.startswith("cpu")
    assert generate(llm, prompts) == hf_greedy(path, prompts)
    llm.engine.check_idle()


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the runner and the paged cache."""
    bm, runner = llm.engine.block_manager, llm.engine.runner
    assert bm.allocate(10**6, len(ids), 0) == []
    out = SchedulerOutput(seqs=[ScheduledSeq(10**6, ids, 0, bm.block_table(10**6), True)],
                          num_decodes=int(len(ids) == 1))
    inp, ctx, _ = runner.prepare(out)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(inp, ctx))
    bm.free_seq(10**6)
    return logits


@pytest.mark.parametrize("family", families_verifying("logits"))
def test_prefill_logits_within_tolerance(make_ckpt, prompts, family):
    path = checkpoint(make_ckpt, family)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    for p in (prompts[3], prompts[-1]):
        with torch.no_grad():
            ref = hf_model(path)(torch.tensor([p])).logits[0].float()
        assert (prefill_logits(llm, p) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", families_verifying("bf16"))
def test_bf16_teacher_forced_top1(make_ckpt, prompts, family):
    """The fp32 model's greedy continuations fed back through the bf16 model, one decode step per token (so every
    position runs the bf16 decode path): its argmax agrees with the fp32 model's at >= 98% of the positions that
    bf16 itself decides, i.e. where transformers' own bf16 forward agrees with fp32, and overall at least as
    often as transformers' bf16 does, less 2 points.

    (On tiny random weights the top two logits are often closer than bf16's rounding of the hidden state:
    transformers' own bf16 forward scores 95-99% against its fp32 one here, so 98% of every position would
    measure the random weights, not the bf16 path. On the real SmolLM2, test_bf16_accuracy.py holds >= 98% of
    every position.)"""
    path = checkpoint(make_ckpt, family)
    fp32 = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=200)
    continuations = generate(fp32, prompts)
    assert teacher_forced_top1(fp32, prompts, continuations) == continuations  # the fp32 runner, teacher-forced
    bf16 = LLM(str(path), dtype="bfloat16", device="cpu", num_kv_blocks=200)
    assert bf16.engine.runner.kv_cache.dtype == torch.bfloat16
    ours = teacher_forced_top1(bf16, prompts, continuations)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    theirs = []
    with torch.inference_mode():
        for p, c in zip(prompts, continuations):
            theirs.append(hf(torch.tensor([p + c[:-1]])).logits[0, len(p) - 1 :].float().argmax(-1).tolist())
    ours_ok = [a == b for o, c in zip(ours, continuations) for a, b in zip(o, c)]
    theirs_ok = [a == b for t, c in zip(theirs, continuations) for a, b in zip(t, c)]
    decided = [o for o, t in zip(ours_ok, theirs_ok) if t]
    assert sum(decided) >= 0.98 * len(decided), f"{sum(decided)}/{len(decided)} of the positions bf16 decides"
    assert sum(ours_ok) >= sum(theirs_ok) - 0.02 * len(ours_ok), f"{sum(ours_ok)} against transformers' " \
        f"{sum(theirs_ok)} of {len(ours_ok)}"


def teacher_forced_top1(llm: LLM, prompts, continuations) -> list[list[int]]:
    runner, bs = llm.engine.runner, llm.engine.block_manager.block_size
    blocks = max(-(-(len(p) + len(c)) // bs) for p, c in zip(prompts, continuations))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    logits = runner.compute_logits(SchedulerOutput(
        seqs=[ScheduledSeq(i, p, 0, tables[i], True) for i, p in enumerate(prompts)], num_decodes=0))
    top1 = [[t] for t in logits.argmax(-1).tolist()]
    for step in range(1, len(continuations[0])):
        seqs = [ScheduledSeq(i, [c[step - 1]], len(p) + step - 1, tables[i], True)
                for i, (p, c) in enumerate(zip(prompts, continuations))]
        for row, t in zip(top1, runner.compute_logits(SchedulerOutput(seqs=seqs, num_decodes=len(seqs)))
                          .argmax(-1).tolist()):
            row.append(t)
    return top1


TARGET_PARAMS = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=10, temperature=0.8, seed=11, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True, logprobs=0),
]


@pytest.mark.parametrize("family", families_verifying("invariant"))
def test_rows_do_not_depend_on_the_batch(make_ckpt, family):
    """Greedy and seeded sampled targets, alone (one sequence at a time) and then among others of random lengths
    and parameters, with chunked prefill (24-token steps), prefix caching (one other shares a target's first 40
    tokens) and a sliding window shorter than the prompts where the family has one: the same tokens and
    log-probs, bit for bit. (The seeded rows are the 'seeded' claim.)"""
    path = checkpoint(make_ckpt, family)
    rng = random.Random(5)
    targets = [[rng.randrange(3, 2000) for _ in range(n)] for n in (9, 45, 70)]
    alone = LLM(str(path), dtype="float32", device="cpu", batch_invariant=True, max_num_seqs=1,
                enable_prefix_caching=False, num_kv_blocks=64)
    expected = [run(alone, [p], [sp])[0] for p, sp in zip(targets, TARGET_PARAMS)]
    assert expected[1][0] != expected[0][0] or expected[2][0] != expected[0][0]  # the sampled rows sampled
    others = [targets[1][:40] + [rng.randrange(3, 2000) for _ in range(5)]]
    others += [[rng.randrange(3, 2000) for _ in range(rng.randrange(1, 80))] for _ in range(6)]
    other_params = [SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 0.7]),
                                   seed=rng.randrange(100), ignore_eos=True) for _ in others]
    crowded = LLM(str(path), dtype="float32", device="cpu", batch_invariant=True, max_num_seqs=6,
                  max_num_batched_tokens=24, num_kv_blocks=96)
    got = run(crowded, others[:3] + targets + others[3:], other_params[:3] + TARGET_PARAMS + other_params[3:])
    assert got[3:6] == expected


def run(llm: LLM, prompts, params) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("family", families_verifying("triton"))
def test_greedy_on_the_triton_kernels(make_ckpt, prompts, family):
    """The Triton backend (compiled on a GPU; interpreted without one: slow, so three prompts, 8 tokens) gives
    transformers' tokens."""
    from test_kernels import DEVICE  # CUDA where there is a GPU (compiled Triton), else the CPU (interpreted)

    path = checkpoint(make_ckpt, family)
    short = [prompts[1], prompts[3], prompts[4]]
    llm = LLM(str(path), dtype="float32", device=DEVICE.type, attention_backend="triton", num_kv_blocks=64,
              num_speculative_tokens=0)
    assert llm.engine.runner.backend.name == "triton"
    assert generate(llm, short, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) == \
        hf_greedy(path, short, 8)


def test_blocks_behind_every_layers_window_go_back(make_ckpt):
    """A model whose every layer has a sliding window (Mistral's, 28 keys) holds only its window's blocks: a
    210-token sequence runs on a 9-block pool of 16 tokens (144 slots) without a preemption, with transformers'
    tokens; a second run of the prompt on a roomier pool maps its released blocks from the prefix cache; then
    several such sequences on the small pool preempt by swap (tables with holes go to the host and back) and by
    recompute, with the same tokens each time. A model with a global layer (Gemma 2) keeps every block."""
    path = checkpoint(make_ckpt, "mistral")
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, 2000, (150,), generator=g).tolist()
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=9, max_num_batched_tokens=32,
              num_speculative_tokens=0)
    assert llm.engine.block_manager.sliding_window == 28 and llm.max_model_len >= 210
    assert generate(llm, [long], params) == hf_greedy(path, [long], 60)
    metrics = llm.metrics()
    assert metrics["num_preemptions_swap"] + metrics["num_preemptions_recompute"] == 0
    llm.engine.check_idle()
    roomy = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=40, num_speculative_tokens=0)
    first = generate(roomy, [long], params)  # released blocks keep their K/V in the prefix cache: a second run
    assert generate(roomy, [long], params) == first  # maps them (the window's blocks are computed again)
    assert roomy.metrics()["prefix_cache_hit_tokens"] >= 128
    roomy.engine.check_idle()
    several = [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (40, 90, 120, 70)]
    refs = hf_greedy(path, several, 30)
    for mode in ("swap", "recompute"):
        crowded = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=9, max_num_batched_tokens=32,
                      preemption_mode=mode, swap_space=2**20, num_speculative_tokens=0)
        assert generate(crowded, several, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) == refs
        assert crowded.metrics()[f"num_preemptions_{mode}"] > 0, mode
        crowded.engine.check_idle()
    gemma = LLM(str(checkpoint(make_ckpt, "gemma2")), dtype="float32", device="cpu", num_kv_blocks=64)
    assert gemma.engine.block_manager.sliding_window is None


def test_phi3_longrope_switches_to_the_long_factors_past_the_original_context(tokenizer, tmp_path, prompts):
    """Phi-3's LongRoPE with original_max_position_embeddings 160: prompts within it, and generation past it
    (the 150-token prompt's tokens 160-173 rotate with the long factors, as transformers switches): transformers'
    greedy tokens. (A prompt longer than the original context is rotated by transformers with the long factors
    from its first position: docs/models.md, limits.)"""
    from conftest import ARCH_SPECS

    from batchrun.model.weights.builtin import make_checkpoint

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 160,
            "short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [1.5 + 0.7 * i for i in range(8)]}
    spec = {**ARCH_SPECS["phi3"], "sliding_window": None, "rope_parameters": rope, "max_position_embeddings": 1024}
    path = make_checkpoint(tmp_path / "phi3-longrope", "phi3", tokenizer=tokenizer, init_std=0.05, **spec)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=200)
    assert generate(llm, prompts) == hf_greedy(path, prompts)
