"""A shared prefix computed once, even when its sharers are admitted in the same step.

Sixteen prompts that start with the same 160 tokens, submitted together: the first one admitted computes
the prefix, the fifteen admitted after it in that step map its blocks (published ahead of the step) and
compute only their own suffix. fp32 greedy outputs must be token-identical to prefix caching off and to
transformers, also when the prefix is split over two steps (chunked prefill), under forced swap and recompute
preemption, and for n > 1 and beam search.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import LLM, BeamSearchParams, SamplingParams

PREFIX_LEN = 160  # 10 full blocks of 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(14)
    prefix = torch.randint(3, 2000, (PREFIX_LEN,), generator=g).tolist()
    return [{"prompt_token_ids": prefix + torch.randint(3, 2000, (1 + i % 7,), generator=g).tolist()}
            for i in range(16)]


def generate(path, prompts, params=GREEDY, **kw):
    llm = LLM(str(path), dtype="float32", **{"num_kv_blocks": 400, **kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_idle()
    return llm, [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def unshared(tiny_llama_path, prompts):
    """Prefix caching off: every prompt computes its prefix itself."""
    llm, got = generate(tiny_llama_path, prompts, enable_prefix_caching=False)
    assert llm.metrics()["prefix_cache_hit_tokens"] == 0
    return got


def test_sixteen_sharers_admitted_together_compute_the_prefix_once(tiny_llama_path, prompts, unshared):
    llm, got = generate(tiny_llama_path, prompts)
    m = llm.metrics()
    assert m["prefix_cache_hit_tokens"] == 15 * PREFIX_LEN  # each of the fifteen maps all ten blocks
    assert m["num_steps"] == GREEDY.max_tokens  # all sixteen were admitted in the first step
    assert got == unshared


def test_outputs_match_transformers(tiny_llama_path, prompts, unshared):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    same = 0
    for p, ours in zip(prompts, unshared):
        ids = torch.tensor([p["prompt_token_ids"]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                          min_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        same += ours[0] == ref.tolist()
    assert same == len(prompts)


def test_a_prefix_chunked_over_two_steps(tiny_llama_path, prompts, unshared):
    # a 100-token budget: the first prompt's prefix takes two steps, the others join in the second
    llm, got = generate(tiny_llama_path, prompts, max_num_batched_tokens=100)
    assert got == unshared
    # all ten blocks for each of the fifteen (sharing only what was computed before the second step: 2336)
    assert llm.metrics()["prefix_cache_hit_tokens"] == 15 * PREFIX_LEN


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_sharing_under_forced_preemption(tiny_llama_path, prompts, unshared, mode):
    # 20 blocks: the shared prefix (10) plus what 16 growing suffixes need does not fit
    llm, got = generate(tiny_llama_path, prompts, num_kv_blocks=20, swap_space="64MiB", preemption_mode=mode)
    assert got == unshared
    m = llm.metrics()
    # the first step admits as many as fit, sharing the prefix; a late one may find it evicted (by swap-ins)
    assert m["prefix_cache_hit_tokens"] >= 8 * PREFIX_LEN
    assert m[f"num_preemptions_{mode}"] > 0


def test_n_greater_than_one_and_beam_search(tiny_llama_path, prompts):
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    on_llm, on = generate(tiny_llama_path, prompts[:6], sampled)
    _, off = generate(tiny_llama_path, prompts[:6], sampled, enable_prefix_caching=False)
    assert on == off
    assert on_llm.metrics()["prefix_cache_hit_tokens"] >= 5 * PREFIX_LEN
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    results = {}
    for caching in (True, False):
        llm = LLM(str(tiny_llama_path), dtype="float32", num_kv_blocks=400, enable_prefix_caching=caching)
        out = llm.beam_search(prompts[:4], beams)
        results[caching] = [[s.tokens for s in r.sequences] for r in out]
        llm.engine.check_idle()
    assert results[True] == results[False]


def test_triton_backend_shares_in_the_same_step_like_the_torch_backend(tiny_llama_path):
    """The Triton kernels (interpreted on a CPU) store the step's K/V before attending too: a prompt that maps
    a prefix another computes in the same step gets the torch backend's greedy tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 2000, (19,), generator=g).tolist()  # 2 full blocks of 8, then 3 tokens
    prompts = [{"prompt_token_ids": prefix + [40 + i, 50 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens, hits = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_path), device=device, dtype="float32", block_size=8, num_kv_blocks=32,
                  attention_backend=backend)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        hits[backend] = llm.metrics()["prefix_cache_hit_tokens"]
        llm.engine.check_idle()
    assert tokens["triton"] == tokens["torch"]
    assert hits["triton"] == hits["torch"] == 2 * 16


def test_shared_prefix_benchmark_smoke(tmp_path):
    """The benchmark runs end to end (no timing is asserted: the machine may be loaded)."""
    import json

    from benchmarks.micro.shared_prefix import main

    out = tmp_path / "r.json"
    assert main(["--rows", "6", "--prefix-len", "48", "--suffix-len", "3", "--output-len", "2", "--json",
                 str(out)]) == 0
    r = json.loads(out.read_text())
    off, on = r["rows"]
    assert r["identical_outputs"] == 6
    assert off["prefix_cache_hit_tokens"] == 0 and on["prefix_cache_hit_tokens"] == 5 * 48
    assert on["prompt_tokens_computed"] == 48 + 6 * 3
