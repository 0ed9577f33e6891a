"""The decoder layers in one native call (model/arch/native_layers.py) against the Python loop they replace: every
step the call serves is run both ways on the same inputs, and the last layer's output, the residual stream and the
KV pool must be equal bit for bit, in fp32 and bf16, batch invariant or not, with q/k/v biases, windows, partial
rotary dims, per-head q/k norms, an int8 KV pool and int8 / int4 weights; mixed prefill and decode steps, chunked
prompts and prefix hits included. Layers the call does not run keep the Python loop."""

from __future__ import annotations

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels.cpu import decoder, linears
from batchrun.model.arch.native_layers import NativeLayers

pytestmark = pytest.mark.skipif(not (decoder.available() and linears.has_panel_linears()),
                                reason="needs the C kernels with their linear panels (AVX2 or AVX-512)")

@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    """On whatever the CPU (by default only where it was measured: native_layers.MEASURED_KERNELS)."""
    monkeypatch.setenv("BATCHRUN_NATIVE_LAYERS", "1")


PROMPTS = ["the cat sat on the mat and then " * 3, "hello there", "the cat sat on the mat and then " * 3 + "a dog",
           "one two three four five six seven eight nine ten eleven twelve", "x"]


def python_layers(model, x, ctx):
    residual = None
    for layer in model.layers:
        x, residual = layer(x, residual, ctx)
    return x, residual


def checked(native: NativeLayers, model, served: list[int]):
    """native.run, with each step it serves run again by the Python loop and compared bit for bit."""
    run = native.run

    def both(x, ctx):
        got = run(x.clone(), ctx)
        if got is None:
            return None
        out, residual = got[0].clone(), got[1].clone()
        pool = ctx.kv_cache.clone()
        want_out, want_residual = python_layers(model, x.clone(), ctx)
        assert torch.equal(out, want_out)
        assert torch.equal(residual, want_residual)
        assert torch.equal(pool.view(torch.uint8), ctx.kv_cache.view(torch.uint8))
        served.append(x.shape[0])
        return out, residual

    return both


def _generate(path, **engine) -> tuple[list[list[int]], list[int]]:
    llm = LLM(str(path), device="cpu", kv_cache_memory="16MiB", max_num_batched_tokens=24, **engine)
    model = llm.engine.runner.model
    native = model.native_layers
    assert native is not None, "the model's layers should take the native call"
    served: list[int] = []
    native.run = checked(native, model, served)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    outs = llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))])
    return [list(o.outputs[0].token_ids) for o in outs], served


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v biases
    ("mistral", {"sliding_window": 12}),
    ("phi3", {}),  # partial rotary dims, a window
    ("qwen3", {}),  # per-head q/k norms
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_layers_equal_the_python_loop(make_ckpt, arch, overrides, dtype):
    tokens, served = _generate(make_ckpt(arch, **overrides), dtype=dtype)
    assert len(served) > 10 and max(served) > 1  # decode steps, and steps with prompt chunks
    assert all(len(t) == 10 for t in tokens)


@pytest.mark.parametrize("engine", [dict(batch_invariant=True), dict(kv_cache_dtype="int8"),
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
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)]
    off = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))])]
    assert served and on == off


@pytest.mark.parametrize("arch", ["gemma2", "granite", "olmo2"])
def test_other_layers_keep_the_python_loop(make_ckpt, arch):
    llm = LLM(str(make_ckpt(arch)), device="cpu", kv_cache_memory="16MiB", dtype="float32")
    assert llm.engine.runner.model.native_layers is None
    assert llm.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids


def test_steps_past_the_row_limit_take_the_python_loop(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory="16MiB", dtype="bfloat16")
    native = llm.engine.runner.model.native_layers
    assert native is not None
    runner = llm.engine.runner
    ctx = type("Ctx", (), {"attn": type("Meta", (), {"has_padding": False})(), "kv_cache": runner.kv_cache,
                           "backend": runner.backend, "ops": runner.ops})()
    assert native.run(torch.zeros(native.max_rows + 1, 64, dtype=torch.bfloat16), ctx) is None


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
