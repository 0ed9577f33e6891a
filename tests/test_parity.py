"""Greedy outputs token for token, and prefill logits, against transformers on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import LLM, SamplingParams
from batchrun.engine.contract import ScheduledSeq, SchedulerOutput

LENGTHS = [1, 2, 5, 16, 17, 31, 33, 64, 100, 128, 150, 200, 255, 256, 299, 300]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in LENGTHS]


_REFS: dict = {}


def hf_reference(path, prompts):
    """transformers' greedy generate, one prompt at a time (cached per checkpoint)."""
    if path not in _REFS:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs = []
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                              do_sample=False, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
        _REFS[path] = (hf, refs)
    return _REFS[path]


def run(path, prompts, **kw):
    llm = LLM(str(path), **{"num_kv_blocks": 600, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.check_idle()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_parity(make_ckpt, prompts, arch):
    path = make_ckpt(arch)
    _, refs = hf_reference(path, prompts)
    llm, got = run(path, prompts)
    assert got == refs
    assert llm.metrics()["num_requests_finished"] == len(prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_parity_under_recompute_preemption(make_ckpt, prompts, arch):
    path = make_ckpt(arch)
    _, refs = hf_reference(path, prompts)
    # 40 blocks of 16 = 640 slots for ~2,500 prompt + 512 generated tokens: preemption is forced
    llm, got = run(path, prompts, num_kv_blocks=40, preemption_mode="recompute")
    assert got == refs
    assert llm.metrics()["num_preemptions_recompute"] > 0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_parity_with_chunked_prefill(make_ckpt, prompts, arch):
    path = make_ckpt(arch)
    _, refs = hf_reference(path, prompts)
    # prompts up to 300 tokens through a 48-token step budget: every long prompt is prefilled in chunks
    llm, got = run(path, prompts, max_num_batched_tokens=48, max_num_seqs=8)
    assert got == refs
    assert llm.metrics()["num_steps"] > sum(LENGTHS) // 48


def _prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the runner and the paged cache."""
    bm, runner = llm.engine.block_manager, llm.engine.runner
    assert bm.allocate(10**6, len(ids), 0) == []
    table = bm.block_table(10**6)
    out = SchedulerOutput(seqs=[ScheduledSeq(10**6, ids, 0, table, True)], num_decodes=int(len(ids) == 1))
    inp, ctx, _ = runner.prepare(out)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(inp, ctx))
    bm.free_seq(10**6)
    return logits


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_prefill_logits_match_transformers(make_ckpt, prompts, arch):
    path = make_ckpt(arch)
    hf, _ = hf_reference(path, prompts)
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)  # the CPU path (the logits are compared on the host)
    for p in (prompts[7], prompts[-1]):
        ours = _prefill_logits(llm, p)
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_with_onednn_linears(make_ckpt, prompts, arch, monkeypatch):
    from batchrun.model.layers.linear import OneDNNLinear

    path = make_ckpt(arch)
    _, refs = hf_reference(path, prompts)
    monkeypatch.setenv("BATCHRUN_CPU_MATMUL", "onednn")
    monkeypatch.setenv("BATCHRUN_F32_LINEAR", "0")  # (else the default batch-invariant mode takes batchrun's kernel)
    llm, got = run(path, prompts, device="cpu")  # oneDNN's linears are the CPU's
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, OneDNNLinear) and isinstance(layer.mlp.down_proj, OneDNNLinear)
    assert got == refs


def test_onednn_choice(make_ckpt, monkeypatch):
    from batchrun.model.layers import linear
    from batchrun.model.weights.loader import load_model

    model = load_model(str(make_ckpt("llama")), dtype=torch.float32, device=torch.device("cpu"), max_model_len=None).model
    cpu = torch.device("cpu")
    assert not linear.use_onednn(model, cpu, torch.float32)  # a small model's weights stay in cache
    # bf16: oneDNN's reordered weights beat F.linear at every size, where the CPU has bf16 kernels
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert linear.use_onednn(model, cpu, torch.bfloat16) == bf16
    assert not linear.use_onednn(model, cpu, torch.float16)
    monkeypatch.setattr(linear, "ONEDNN_MIN_BYTES", 0)
    assert linear.use_onednn(model, cpu, torch.float32) == torch.backends.mkldnn.is_available()
    monkeypatch.setenv("BATCHRUN_CPU_MATMUL", "mkl")
    assert not linear.use_onednn(model, cpu, torch.float32)
    assert not linear.use_onednn(model, cpu, torch.bfloat16)
    monkeypatch.setenv("BATCHRUN_CPU_MATMUL", "fast")
    with pytest.raises(ValueError, match="BATCHRUN_CPU_MATMUL"):
        linear.use_onednn(model, cpu, torch.float32)


def test_a_long_prefill_mlp_runs_in_row_chunks_with_the_same_bits(make_ckpt, prompts, monkeypatch):
    """The MLP of a prefill whose gate|up activations pass MLP_CHUNK_BYTES runs in row chunks (arch/blocks.py): with
    batch-invariant linears every row gets the bits of the whole call, and greedy outputs stay transformers'."""
    from batchrun.model.arch import blocks

    assert blocks.mlp_chunk_rows(100, 1000) == 100
    assert blocks.mlp_chunk_rows(4096, 3072 * 4) == 1024  # SmolLM2 fp32: 12.5 MB chunks of a 50 MB activation
    assert blocks.mlp_chunk_rows(4096, 3072 * 2) == 4096  # bf16: 25 MB, one call
    path = make_ckpt("llama")
    _, refs = hf_reference(path, prompts)
    # no drafts: every decode step then has fewer rows than one chunk, and every larger call is a prefill's
    llm = LLM(str(path), dtype="float32", device="cpu", batch_invariant=True, num_kv_blocks=600,
              num_speculative_tokens=0)
    mlp = llm.engine.runner.model.layers[0].mlp
    x = torch.randn(37, mlp.gate_up_proj.in_features)
    ops = llm.engine.runner.ops
    whole = mlp(x, ops)
    calls = []
    gate_up = mlp.gate_up_proj.forward
    monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda h: calls.append(h.shape[0]) or gate_up(h))
    monkeypatch.setattr(blocks, "MLP_CHUNK_BYTES", 8 * 2 * mlp.inter * 4)  # 8 rows' activations
    assert torch.equal(mlp(x, ops), whole)
    assert calls == [4] * 9 + [1]  # chunks under half the limit, the last one short
    calls.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert max(calls) == 4 and len(calls) > 2 * len(prompts)  # the prefills were chunked
    assert [o.outputs[0].token_ids for o in outs] == refs
