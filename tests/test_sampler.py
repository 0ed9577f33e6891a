"""Sampler: greedy, the allowed sets of top-k / top-p / min-p, per-request seeds, and the distribution."""

import math

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.model.sampling.sampler import SamplingBatch, sample, uniform


def batch(rows, *, temperature=1.0, top_k=None, top_p=None, min_p=None, seeds=None, counters=None):
    return SamplingBatch(
        temperature=torch.full((rows,), float(temperature)),
        top_k=None if top_k is None else torch.full((rows,), top_k),
        top_p=None if top_p is None else torch.full((rows,), float(top_p)),
        min_p=None if min_p is None else torch.full((rows,), float(min_p)),
        seeds=torch.arange(rows, dtype=torch.int64) if seeds is None else seeds,
        counters=torch.zeros(rows, dtype=torch.int64) if counters is None else counters,
        all_greedy=not temperature,
    )


def test_uniform_is_a_pure_function_of_seed_and_counter():
    seeds = torch.tensor([1, 2, 3, 1], dtype=torch.int64)
    counters = torch.tensor([0, 0, 0, 5], dtype=torch.int64)
    u = uniform(seeds, counters)
    assert ((u >= 0) & (u < 1)).all()
    assert u[0] == uniform(torch.tensor([1]), torch.tensor([0]))[0]
    assert len(set(u.tolist())) == 4
    big = uniform(torch.arange(200_000, dtype=torch.int64), torch.zeros(200_000, dtype=torch.int64))
    assert abs(big.mean().item() - 0.5) < 0.005  # 0.5 +- 5 standard errors


def test_temperature_zero_is_greedy():
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits, batch(64, temperature=0)).tokens, logits.argmax(-1))


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_never_outside_the_allowed_set(kind):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(256, 300, generator=g) * 3
    probs = logits.softmax(-1)
    kw = {"top_k": dict(top_k=5), "top_p": dict(top_p=0.3), "min_p": dict(min_p=0.2)}[kind]
    for step in range(20):
        tok = sample(logits, batch(256, counters=torch.full((256,), step), **kw)).tokens
        p_tok = probs.gather(1, tok[:, None]).squeeze(1)
        if kind == "top_k":
            allowed = p_tok >= probs.topk(5, dim=-1).values[:, -1]
        elif kind == "top_p":
            # mass of the tokens strictly more likely than the chosen one must be < top_p
            before = (probs * (probs > p_tok[:, None])).sum(-1)
            allowed = before < 0.3 + 1e-6
        else:
            allowed = p_tok >= 0.2 * probs.max(-1).values - 1e-7
        assert allowed.all()


def test_temperature_sampling_matches_softmax_chi_square():
    """Draws from one row across 20,000 counters follow softmax(logits / T) (fixed seed: deterministic)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temperature = 0.7
    n = 20_000
    b = batch(n, temperature=temperature, seeds=torch.full((n,), 1234, dtype=torch.int64),
              counters=torch.arange(n, dtype=torch.int64))
    tok = sample(logits.expand(n, -1).contiguous(), b).tokens
    observed = torch.bincount(tok, minlength=6).double()
    expected = (logits[0] / temperature).softmax(-1).double() * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    assert observed.min() > 0  # even a 0.3% token is drawn


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), num_kv_blocks=400)
    mine = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=77, ignore_eos=True)
    alone = llm.generate(["the river and the stone"], mine, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"prompt number {i} about a {'long ' * (i % 7)}road" for i in range(32)]
    params = [SamplingParams(max_tokens=16 + i % 9, temperature=0.8 + i % 3 * 0.1, seed=i) for i in range(32)]
    outs = llm.generate(others[:16] + ["the river and the stone"] + others[16:], params[:16] + [mine] + params[16:],
                        use_tqdm=False)
    assert outs[16].outputs[0].token_ids == alone
    # and different seeds give different samples
    other = llm.generate(["the river and the stone"], SamplingParams(max_tokens=24, temperature=1.0, seed=78,
                                                                       ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone


def test_unseeded_requests_follow_the_llm_seed(tiny_llama_path):
    sp = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    a = LLM(str(tiny_llama_path), num_kv_blocks=100, seed=1).generate(["a b c", "d e f"], sp, use_tqdm=False)
    b = LLM(str(tiny_llama_path), num_kv_blocks=100, seed=1).generate(["a b c", "d e f"], sp, use_tqdm=False)
    c = LLM(str(tiny_llama_path), num_kv_blocks=100, seed=2).generate(["a b c", "d e f"], sp, use_tqdm=False)
    ids = [[o.outputs[0].token_ids for o in r] for r in (a, b, c)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_penalties_change_what_repeats():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 2.0
    logits[0, 4] = 1.9
    b = batch(1, temperature=0)
    b.repetition = torch.tensor([2.0])
    b.presence = torch.tensor([0.0])
    b.frequency = torch.tensor([0.0])
    b.prompt_mask = torch.zeros(1, 10, dtype=torch.bool)
    b.prompt_mask[0, 3] = True
    b.output_counts = torch.zeros(1, 10)
    assert sample(logits, b).tokens.item() == 4  # 2.0 / 2 < 1.9
    b.repetition = torch.tensor([1.0])
    b.prompt_mask[0, 3] = False
    b.output_counts[0, 4] = 3
    b.frequency = torch.tensor([0.1])  # 1.9 - 0.3
    assert sample(logits, b).tokens.item() == 3
    b.output_counts[0, 4] = 0
    b.output_counts[0, 3] = 1
    b.presence = torch.tensor([0.5])
    b.frequency = torch.tensor([0.0])
    assert sample(logits, b).tokens.item() == 4


def test_logprobs_are_reported(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), num_kv_blocks=100)
    out = llm.generate(["a river"], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and len(entry) == 3  # greedy: the chosen token is the top one
        assert max(entry.values()) == entry[tok] <= 0
    assert math.isclose(out.cumulative_logprob, sum(e[t] for t, e in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-6)
