"""SamplingParams(prompt_logprobs=K) with vLLM's semantics, against transformers' log_softmax in fp32: the first prompt
token gets None, every other its own log-probability and rank and the K most likely there; the same with the prefix
cache holding the prompt, in chunks, under preemption, and with nothing generated (max_tokens 0)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import LLM, SamplingParams
from batchrun.model.arch.registry import families_verifying
from tests.test_families import CHECKPOINTS, checkpoint

TOL = 1e-4
K = 3


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (1, 2, 9, 40, 77, 130)]


def reference(path, prompt):
    """(log-probabilities [len - 1, vocab]) of each prompt token after the first, by transformers in fp32."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def check(entries, prompt, ref, k=K):
    assert len(entries) == len(prompt) and entries[0] is None
    for pos, entry in enumerate(entries[1:], start=1):
        token, row = prompt[pos], ref[pos - 1]
        assert abs(entry[token].logprob - row[token].item()) <= TOL
        # the rank counts the tokens more likely; those within the tolerance of it may fall either side
        x = row[token]
        assert int((row > x + TOL).sum()) + 1 <= entry[token].rank <= int((row > x - TOL).sum()) + 1
        assert len(entry) <= k + 1
        top = row.topk(k)
        for lp, t in zip(top.values.tolist(), top.indices.tolist()):
            assert t in entry and abs(entry[t].logprob - lp) <= TOL


@pytest.mark.parametrize("family", [f for f in families_verifying("logits") if f in CHECKPOINTS])
def test_prompt_logprobs_equal_transformers(make_ckpt, prompts, family):
    path = checkpoint(make_ckpt, family)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1)
        check(out.prompt_logprobs, p, ref)
        assert out.outputs[0].text == "" and all(e[t].decoded_token is None for e, t in
                                                  zip(out.prompt_logprobs[1:], p[1:]))
    llm.engine.check_idle()


def test_with_the_prefix_cache_chunks_and_preemption(make_ckpt, prompts):
    """A second request with the same prompt finds it in the prefix cache, yet every position is scored; chunks of
    16 tokens, a pool that forces recompute preemption, and max_tokens 0 give the same values."""
    path = make_ckpt("llama")
    prompt = prompts[-1]
    ref = reference(path, prompt)
    params = SamplingParams(max_tokens=0, prompt_logprobs=K)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    plain = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and again.num_cached_tokens == 0  # scored requests compute their prompt
    for out in (first, again):
        check(out.prompt_logprobs, prompt, ref)
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    chunked = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=16)
    check(chunked.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].prompt_logprobs, prompt, ref)
    # 20 blocks of 16 for 4 x 130-token prompts and their outputs: recompute preemption is forced
    tight = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=20, preemption_mode="recompute",
                max_num_batched_tokens=64)
    outs = tight.generate([{"prompt_token_ids": prompt}] * 4,
                          SamplingParams(max_tokens=40, ignore_eos=True, prompt_logprobs=K), use_tqdm=False)
    assert tight.metrics()["num_preemptions_recompute"] > 0
    for out in outs:
        check(out.prompt_logprobs, prompt, ref)
    tight.engine.check_idle()


def test_on_the_real_model(smollm2, smollm2_path):
    """SmolLM2 in fp32: a chat prompt's log-probabilities equal transformers', decoded tokens are the token texts."""
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    out = smollm2.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=1),
                           use_tqdm=False)[0]
    check(out.prompt_logprobs, prompt, reference(smollm2_path, prompt), k=1)
    assert [out.prompt_logprobs[i][t].decoded_token for i, t in enumerate(prompt) if i] == \
        [tok.decode([t]) for t in prompt[1:]]


def test_sampled_logprobs_carry_their_rank(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), dtype="float32", device="cpu", num_kv_blocks=32)
    out = llm.generate(["hello there"], SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        top = sorted((lp for t, lp in entry.items() if t != token or lp.rank <= 2), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][:2] == [1, 2] and entry[token].rank >= 1
        assert top[0].logprob >= top[1].logprob >= entry[token].logprob or entry[token].rank <= 2
        assert isinstance(entry[token].decoded_token, str)


def test_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    assert SamplingParams(logits_processors=[], max_tokens=0).max_tokens == 0


def test_scoring_from_a_token_lets_the_prefix_cache_give_the_rest(make_ckpt, prompts):
    """add_request(score_from=s): positions before s are None and may come from the prefix cache (a loglikelihood
    row's shared context); the scored ones equal transformers' all the same."""
    path = make_ckpt("llama")
    prompt = prompts[-1]
    ref = reference(path, prompt)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    outs = {}
    for rid in ("a", "b"):  # the second finds the first's blocks in the cache
        llm.add_request(rid, prompt, params, score_from=100)
        while llm.has_unfinished():
            outs.update((o.request_id, o) for o in llm.step())
    for out in outs.values():
        assert out.prompt_logprobs[:100] == [None] * 100 and len(out.prompt_logprobs) == len(prompt)
        check([None] + out.prompt_logprobs[100:], [prompt[0]] + prompt[100:],
              torch.cat([ref[:0], ref[99:]]), k=1)
    assert outs["a"].num_cached_tokens == 0 and outs["b"].num_cached_tokens == 96  # six blocks of 16 before row 99


def test_a_scored_prompt_may_fill_max_model_len(make_ckpt, prompts):
    """A harness's rolling windows are exactly max_model_len tokens: scored, such a prompt runs (its log-probabilities
    equal transformers', no token generated, ended by length); generating from it, or scoring one token more, is
    refused in one line."""
    path = make_ckpt("llama")
    prompt = prompts[-1]
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=len(prompt))
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False),
                       use_tqdm=False)[0]
    check(out.prompt_logprobs, prompt, reference(path, prompt), k=1)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="leaving no room to generate"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=f"scores at most {len(prompt)}"):
        llm.generate([{"prompt_token_ids": prompt + [5]}], SamplingParams(max_tokens=0), use_tqdm=False)
    llm.engine.check_idle()
