"""The lm_head in int8 (EngineArgs.quantize_lm_head; batchrun/model/quant/linear.py: quantize_lm_head).

Its logits are approximate, and each row's 8 largest are recomputed from the plain weights (the embedding when
tied, the kept weight when not): greedy tokens are the plain lm_head's wherever the model's first choice is among
the int8 logits' 8 largest, which on these tiny models (peaked logits) is every position; a row's tokens still do
not depend on its batch in the batch-invariant mode; and the setting is checked before anything loads.
"""

import random

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels.cpu import quant as quant_kernels
from batchrun.model.quant.linear import LM_HEAD_SPEC, QuantLinear

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="needs a C compiler for batchrun's CPU kernels")


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (2, 9, 33, 70)]


def _greedy(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, got)] for o, got in zip(outs, tokens)]
    return tokens, torch.tensor(logprobs, dtype=torch.float64)


# An untied bf16 lm_head is not compared: on oneDNN it keeps only its reordered copy, so its plain logits are
# bf16-rounded, never refined, and differ from the refined ones by rounding (the next test checks its refinement).
@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("qwen2", "float32"), ("qwen2", "bfloat16")],
                         ids=["untied-float32", "tied-float32", "tied-bfloat16"])
def test_greedy_tokens_are_the_plain_lm_heads(make_ckpt, arch, dtype):
    path = make_ckpt(arch)
    plain = LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=64)
    prompts = _prompts(plain.config.vocab_size)
    want, want_logprobs = _greedy(plain, prompts)
    del plain
    llm = LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=64, quantize_lm_head=True)
    model = llm.engine.runner.model
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.packed is not None and head.bits == 8
    tied = model.config.tie_word_embeddings
    assert tied == (arch == "qwen2")
    # the refined logits' source: the embedding when tied, else the lm_head's own plain weight kept aside
    assert (head.refine_weight is None) == tied and model.lm_weight is not None
    assert model.lm_weight.dtype == getattr(torch, dtype)
    got, got_logprobs = _greedy(llm, prompts)
    assert got == want
    # the chosen token's logit is exact; the rest of the softmax's sum comes from the int8 logits
    assert torch.allclose(got_logprobs, want_logprobs, atol=0.05), (got_logprobs - want_logprobs).abs().max()


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "bfloat16")],
                         ids=["untied-float32", "untied-bfloat16", "tied-bfloat16"])
def test_the_refined_logits_are_the_plain_weights_dot_products(make_ckpt, arch, dtype):
    """compute_logits on the int8 lm_head: at least 8 entries of each row (the int8 logits' 8 largest) are the fp32
    dot products of the plain weights (what refine_top_logits writes; a bmm there, a matmul here: equal up to
    summation order), so each row's argmax is the plain weights' exact one; the rest are within int8's error."""
    path = make_ckpt(arch)
    llm = LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=16, quantize_lm_head=True)
    model = llm.engine.runner.model
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.lm_weight.dtype)
    logits = model.compute_logits(hidden)
    exact = hidden.float() @ model.lm_weight.float().T
    refined = ((logits - exact).abs() <= 1e-5 * exact.abs().max()).sum(-1)
    assert (refined >= 8).all(), refined  # the int8 logits' 8 largest, recomputed (others match only by chance)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert (logits - exact).abs().max() < 0.05 * exact.abs().max()
    assert not torch.equal(logits, exact)  # the others are the int8 kernel's


def test_a_rows_tokens_do_not_depend_on_its_batch(make_ckpt):
    path = make_ckpt("llama")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, batch_invariant=True,
              quantize_lm_head=True)
    vocab = llm.config.vocab_size
    targets = _prompts(vocab)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    alone = [list(llm.generate([{"prompt_token_ids": p}], sampled, use_tqdm=False)[0].outputs[0].token_ids)
             for p in targets]
    rng = random.Random(0)
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 50))] for _ in range(7)]
    batch = targets + others
    order = list(range(len(batch)))
    rng.shuffle(order)
    outs = llm.generate([{"prompt_token_ids": batch[i]} for i in order], sampled, use_tqdm=False)
    by_index = {i: list(o.outputs[0].token_ids) for i, o in zip(order, outs)}
    assert [by_index[i] for i in range(len(targets))] == alone


def test_the_memory_plan_counts_the_int8_copy(make_ckpt):
    """The plan (batchrun.build.plan_memory) adds the int8 lm_head and, for a tied bf16 lm_head, drops the packed bf16
    copy that model/layers/linear.py would otherwise make of the embedding."""
    from batchrun.build import plan_memory
    from batchrun.kernels.layouts.kv_rows import KV_CACHE_DTYPES
    from batchrun.model.weights.loader import load_config, resolve_path

    for arch, dtype in (("llama", "float32"), ("qwen2", "bfloat16")):
        path = make_ckpt(arch)
        plans = {}
        for quantized in (False, True):
            llm = LLM(str(path), dtype=dtype, device="cpu", num_kv_blocks=16, quantize_lm_head=quantized)
            config = load_config(resolve_path(str(path)))
            plans[quantized] = plan_memory(llm.args, resolve_path(str(path)), config, llm.dtype, llm.batch_invariant,
                                           KV_CACHE_DTYPES[llm.args.kv_cache_dtype]).weights
            if quantized:
                head = llm.engine.runner.model.lm_head
                assert head.nbytes == LM_HEAD_SPEC.held_bytes(config.vocab_size, config.hidden_size)
        packed_copy = config.vocab_size * config.hidden_size * 2 if arch == "qwen2" else 0
        assert plans[True] - plans[False] == head.nbytes - packed_copy


def test_the_setting_is_checked_before_anything_loads(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from batchrun.cli import main
    from batchrun.engine_args import EngineArgs, EngineArgsError

    job = tmp_path / "job.yaml"
    job.write_text("model:\n  path: builtin:tiny-llama\n  quantize_lm_head: maybe\ninput: in.parquet\noutput: out\n")
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2 and "model.quantize_lm_head: expected true or false" in result.output
    assert "Traceback" not in result.output
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CPU only for now: refused where CUDA runs it
    with pytest.raises(EngineArgsError, match="quantize_lm_head: runs on a CPU only"):
        EngineArgs("builtin:tiny-llama", quantize_lm_head=True).check_environment()
    EngineArgs("builtin:tiny-llama", quantize_lm_head=True, device="cpu").check_environment()
