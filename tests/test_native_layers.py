"""A step's forward in one native call (model/arch/native_layers.py) against the Python path it replaces: every
step the call serves is run both ways on the same inputs, and the hidden states after the final norm and the KV
pool must be equal bit for bit, in fp32 and bf16, batch invariant or not, with q/k/v biases, windows, partial
rotary dims, per-head and whole-projection q/k norms, norms after the blocks, sparse MoE blocks, an int8 or fp8 KV
pool and int8 / int4 weights; mixed prefill and decode steps, chunked prompts and prefix hits included. Layers the
call does not run keep the Python loop."""

from __future__ import annotations

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels.cpu import decoder, linears
from batchrun.kernels.cpu import logits as cpu_logits
from batchrun.model.arch.native_layers import NativeLayers

pytestmark = pytest.mark.skipif(not (decoder.available() and linears.has_panel_linears()),
                                reason="needs the C kernels with their linear panels (AVX2 or AVX-512)")

@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    """On whatever the CPU, the fused greedy path too (by default each only where it was measured: the
    MEASURED_KERNELS of native_layers and of kernels/cpu/logits)."""
    monkeypatch.setenv("BATCHRUN_NATIVE_LAYERS", "1")
    monkeypatch.setattr(cpu_logits, "MEASURED_KERNELS", (linears.bf16_kernel(),))


PROMPTS = ["the cat sat on the mat and then " * 3, "hello there", "the cat sat on the mat and then " * 3 + "a dog",
           "one two three four five six seven eight nine ten eleven twelve", "x"]


def python_forward(model, input_ids, ctx):
    """The model's forward with the native call off: embeddings, the layers' loop, the final norm."""
    native, model.native_layers = model.native_layers, None
    try:
        return model(input_ids, ctx)
    finally:
        model.native_layers = native


def check_step(got, model, input_ids, ctx, served: list[int]) -> None:
    """The native call's hidden states and pool equal the Python path's on the same step (run again)."""
    got = got.clone()
    pool = ctx.kv_cache.clone()
    want = python_forward(model, input_ids, ctx)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
    assert torch.equal(pool.view(torch.uint8), ctx.kv_cache.view(torch.uint8))
    served.append(input_ids.shape[0])


def checked(native: NativeLayers, model, served: list[int], greedy_served: list[int] | None = None):
    """native.run and native.run_greedy, each step they serve run again by the Python path and compared bit for
    bit: the hidden states, the pool, and run_greedy's tokens against greedy_tokens of the Python path's."""
    run, run_greedy = native.run, native.run_greedy

    def both(input_ids, ctx):
        got = run(input_ids, ctx)
        if got is not None:
            check_step(got, model, input_ids, ctx, served)
        return got

    def both_greedy(input_ids, ctx, *lm):
        got = run_greedy(input_ids, ctx, *lm)
        if got is not None:
            hidden, tokens = got
            check_step(hidden, model, input_ids, ctx, served)
            want = model.greedy_tokens(python_forward(model, input_ids, ctx))
            assert tokens is not None and want is not None and torch.equal(tokens, want)
            if greedy_served is not None:
                greedy_served.append(input_ids.shape[0])
        return got

    native.run_greedy = both_greedy
    return both


def perturb_norms(model) -> None:
    """Every RMSNorm weight moved in place by its own random amount (the checkpoints' norms are all ones: a norm
    applied with another's weight would go unseen)."""
    from batchrun.model.arch.blocks import RMSNorm

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_((0.2 * torch.randn(module.weight.shape, generator=gen)).to(module.weight.dtype))


def checked_host(runner, served: list[int], sampled: list[int]) -> None:
    """The runner's decode steps planned as host arrays (host_decode.py), each run again through prepare() and the
    Python path: the hidden states, the pool and (greedy steps) the tokens must be equal."""
    from batchrun.engine.contract import SchedulerOutput

    host = runner.host_decode
    assert host is not None
    run, hidden_of = host.run, host.hidden

    def again(seqs, kv_cache, hidden):
        hidden, pool = hidden.clone(), kv_cache.clone()
        ids, ctx, logits_idx = runner.prepare(SchedulerOutput(seqs=seqs, num_decodes=len(seqs)))
        assert logits_idx is None
        want = python_forward(runner.model, ids, ctx)
        assert torch.equal(hidden, want)
        assert torch.equal(pool.view(torch.uint8), kv_cache.view(torch.uint8))
        return want

    def hidden_both(seqs, kv_cache):
        got = hidden_of(seqs, kv_cache)
        if got is not None:
            again(seqs, kv_cache, got)
            sampled.append(len(seqs))
        return got

    def both(seqs, kv_cache):
        got = run(seqs, kv_cache)
        if got is not None:
            want = again(seqs, kv_cache, host.native.hidden_view(len(seqs)))
            assert got == runner.model.greedy_tokens(want).tolist()
            served.append(len(seqs))
        return got

    host.run, host.hidden = both, hidden_both


def _generate(path, greedy_served: list[int] | None = None, **engine) -> tuple[list[list[int]], list[int]]:
    """Greedy and sampled rows together, checked step by step; then, with greedy_served, greedy rows alone (steps
    whose tokens the native call may find itself)."""
    llm = LLM(str(path), device="cpu", kv_cache_memory="16MiB", max_num_batched_tokens=24, **engine)
    model = llm.engine.runner.model
    perturb_norms(model)
    native = model.native_layers
    assert native is not None, "the model's layers should take the native call"
    served: list[int] = []
    native.run = checked(native, model, served, greedy_served)
    host_sampled: list[int] = []
    checked_host(llm.engine.runner, greedy_served if greedy_served is not None else [], host_sampled)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    outs = llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))])
    assert host_sampled, "the decode steps with sampled rows should take the host plan"
    served += host_sampled  # (checked steps, either way)
    if greedy_served is not None:
        llm.generate(PROMPTS[::-1], params[0])
    return [list(o.outputs[0].token_ids) for o in outs], served


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"sliding_window": 12}),
    ("phi3", {}),  # partial rotary dims, a window
    ("qwen3", {}),  # per-head q/k norms
    ("gemma2", {}),  # sandwich norms, GeGLU, scores soft-capped, sliding and global layers, scaled embeddings
    ("gemma3", {}),  # and per-head q/k norms, the sliding layers' own rotary table
    ("granite", {}),  # residual and embedding multipliers
    ("olmo2", {}),  # norms after each block, q/k norms over the whole projection
    ("qwen3_moe", {}),  # sparse MoE blocks: top 2 of 8 renormalised
    ("mixtral", {}),  # top 2 of 5 renormalised, a sliding window
    ("qwen2_moe", {"mlp_only_layers": None}),  # top 3 of 6 not renormalised, a gated shared expert
    ("qwen2_moe", {}),  # and a dense layer between the sparse ones, wider than the shared expert
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_layers_equal_the_python_loop(make_ckpt, arch, overrides, dtype):
    tokens, served = _generate(make_ckpt(arch, **overrides), dtype=dtype)
    assert len(served) > 10 and max(served) > 1  # decode steps, and steps with prompt chunks
    assert all(len(t) == 10 for t in tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_in_the_native_call(make_ckpt, arch):
    """bf16 with a tied lm_head (its plain weight kept: the fused greedy path's): all-greedy steps find their
    tokens in the native call, each step's equal to greedy_tokens of the Python path's hidden states."""
    greedy_served: list[int] = []
    _, served = _generate(make_ckpt(arch, tie_word_embeddings=True), greedy_served, dtype="bfloat16")
    assert len(greedy_served) > 5 and max(greedy_served) > 1


@pytest.mark.parametrize("engine", [dict(batch_invariant=True), dict(kv_cache_dtype="int8"),
                                    dict(kv_cache_dtype="fp8_e4m3"), dict(kv_cache_dtype="fp8_e5m2"),
                                    dict(quantization="int8"), dict(quantization="int4-g32")])
def test_native_layers_in_each_mode(tiny_llama_path, engine):
    _, served = _generate(tiny_llama_path, dtype="bfloat16", **engine)
    assert len(served) > 10


def test_per_head_norms_over_an_int8_pool(make_ckpt):
    _, served = _generate(make_ckpt("qwen3"), dtype="bfloat16", kv_cache_dtype="int8")
    assert len(served) > 10


def test_the_same_tokens_with_the_call_off(tiny_llama_path, monkeypatch):
    on, served = _generate(tiny_llama_path, dtype="bfloat16")
    monkeypatch.setenv("BATCHRUN_NATIVE_LAYERS", "0")
    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory="16MiB", max_num_batched_tokens=24, dtype="bfloat16")
    assert llm.engine.runner.model.native_layers is None
    perturb_norms(llm.engine.runner.model)  # as _generate did
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    off = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))])]
    assert served and on == off


def test_other_layers_keep_the_python_loop(make_ckpt, monkeypatch):
    """Layers the call does not describe (a norm's epsilon unlike the others') leave the model to the Python loop,
    and the log says why."""
    from batchrun.model.arch import native_layers

    llm = LLM(str(make_ckpt("qwen2_moe")), device="cpu", kv_cache_memory="16MiB", dtype="float32")
    runner = llm.engine.runner
    model = runner.model
    assert model.native_layers is not None
    model.layers[1].post_attention_layernorm.eps *= 10
    logged = []
    monkeypatch.setattr(native_layers.log, "info", lambda message, *args: logged.append(message % args))
    assert NativeLayers.build(model, runner.backend, runner.ops, runner.kv_cache) is None
    assert logged == ["decoder layers in Python: layers of different shapes"]


def test_steps_past_the_row_limit_take_the_python_loop(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory="16MiB", dtype="bfloat16")
    native = llm.engine.runner.model.native_layers
    assert native is not None
    runner = llm.engine.runner
    ctx = type("Ctx", (), {"attn": type("Meta", (), {"has_padding": False})(), "kv_cache": runner.kv_cache,
                           "backend": runner.backend, "ops": runner.ops})()
    assert native.run(torch.zeros(native.max_rows + 1, dtype=torch.int64), ctx) is None


def test_another_runner_of_the_model_takes_the_python_loop(tiny_llama_path):
    """A runner made beside the engine's for the same model (another pool: int8 here) is not what the layers were
    described for: its steps take the Python loop, and its results are its own pool's."""
    from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
    from batchrun.model.runner.model_runner import ModelRunner, cache_shape

    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory="16MiB", dtype="float32")
    plain = llm.engine.runner
    native = plain.model.native_layers
    assert native is not None
    served: list[int] = []
    native.run = checked(native, plain.model, served)
    out = SchedulerOutput(seqs=[ScheduledSeq(0, list(range(3, 20)), 0, [0, 1], True)], num_decodes=0)
    shape = cache_shape(plain.model, 16, torch.float32, torch.int8)
    other = ModelRunner(plain.model, shape, 4, 0, torch.device("cpu"))
    got = other.compute_logits(out)
    assert not served  # the int8 pool's runner: the Python loop
    plain.model.native_layers = None
    want = ModelRunner(plain.model, shape, 4, 0, torch.device("cpu")).compute_logits(out)
    assert torch.equal(got, want)
