"""The lm_head with its greedy selection (kernels/cpu/logits.py: linear_top, CausalLM.greedy_tokens): each row's
largest logits found chunk by chunk of the vocabulary, never the whole [rows, vocab] matrix, and the greedy token
exactly the argmax the unfused path (compute_logits, then the sampler) takes."""

import pytest
import torch

from batchrun import LLM, SamplingParams
from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.kernels.cpu import logits as cpu_logits
from batchrun.kernels.cpu import sampling as cpu_sampling
from batchrun.model.arch.blocks import REFINE_TOP, CausalLM
from batchrun.model.sampling.sampler import argmax_rows

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(not cpu_kernels.available() or not cpu_linears.has_panel_linears(),
                                reason="needs the C kernels built with the panel linears (AVX2 or AVX-512)")


def _packed(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(BF)
    return weight, cpu_linears.pack_linear(weight)


@pytest.mark.parametrize("rows, k, n", [(1, 576, 49152), (74, 576, 49152), (5, 64, 1000), (130, 2048, 5003),
                                        (17, 96, 1001)])
def test_linear_top_is_the_top_of_the_whole_linear(rows, k, n):
    """The same values and ids as logits_top over linear_bf16's whole output, in the same order; 130 rows of 5003
    outputs go in two vocabulary chunks, 1001 ends in a short panel."""
    _, packed = _packed(n, k, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(BF)
    whole, top = cpu_sampling.logits_top(cpu_linears.linear_bf16(x, packed, n, None), REFINE_TOP + 1)
    values, ids, nan = cpu_logits.linear_top(x, packed, n, REFINE_TOP + 1)
    assert torch.equal(ids, top)
    assert torch.equal(values, whole.gather(1, top))
    assert torch.equal(nan, torch.full((rows,), -1))
    assert (values[:, :-1] >= values[:, 1:]).all()


def test_linear_top_ties_keep_the_earliest_and_nan_is_reported():
    weight = torch.zeros(1000, 64)
    weight[:, 0] = 1.0  # every output 1.0: the earliest ids win
    weight[[700, 900], 0] = 2.0
    x = torch.ones(3, 64).to(BF)
    values, ids, nan = cpu_logits.linear_top(x, cpu_linears.pack_linear(weight.to(BF)), 1000, 9)
    assert ids[0].tolist() == [700, 900, 0, 1, 2, 3, 4, 5, 6]
    assert values[0].tolist() == [2.0, 2.0] + [1.0] * 7
    _, top = cpu_sampling.logits_top(torch.ones(3, 1000, dtype=BF), 9)  # the unfused pass keeps the same ones
    assert top[0].tolist() == list(range(9))
    weight[500, 1] = float("nan")
    weight[800, 2] = float("nan")
    values, ids, nan = cpu_logits.linear_top(x, cpu_linears.pack_linear(weight.to(BF)), 1000, 9)
    assert nan.tolist() == [500, 500, 500]
    assert ids[0].tolist() == [700, 900, 0, 1, 2, 3, 4, 5, 6]  # NaNs are left out of the kept values


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_refine_logits_is_each_rows_dot_product_alone(dtype):
    """fp32 dot products at the given ids, within fp32 rounding of float64's, each row's bits the same alone as in
    any batch (dim 581: a tail past the vector lanes)."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(40, 581, generator=g).to(dtype), torch.randn(3000, 581, generator=g).to(dtype)
    ids = torch.randint(0, 3000, (40, 8), generator=g)
    out = torch.empty(40, 8)
    cpu_logits.refine_logits(hidden, weight, ids, out)
    exact = torch.einsum("rd,rkd->rk", hidden.double(), weight[ids].double())
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-4)
    for start, rows in ((0, 1), (3, 2), (7, 33)):
        part = torch.empty(rows, 8)
        cpu_logits.refine_logits(hidden[start : start + rows], weight, ids[start : start + rows], part)
        assert torch.equal(part, out[start : start + rows])
    wide = torch.zeros(40, 9)  # into the first 8 columns of a wider matrix, from a slice of wider ids
    cpu_logits.refine_logits(hidden, weight, torch.cat([ids, ids[:, :1]], 1)[:, :8], wide)
    assert torch.equal(wide[:, :8], out) and not wide[:, 8].any()


def test_top_argmax_takes_the_first_maximum_and_declines_a_nan():
    values = torch.tensor([[3.0, 5.0, 5.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    ids = torch.tensor([[10, 40, 7, 3], [9, 8, 12, 30]])
    assert cpu_logits.top_argmax(values, ids, torch.tensor([-1, -1])).tolist() == [7, 8]
    assert cpu_logits.top_argmax(values, ids, torch.tensor([-1, 5])) is None
    values[0, 3] = float("nan")
    assert cpu_logits.top_argmax(values, ids, torch.tensor([-1, -1])) is None


@pytest.mark.parametrize("rows, k, n", [(1, 576, 49152), (37, 96, 5003), (70, 64, 1001)])
def test_sampled_tokens_in_one_call_are_the_unfused_draws(rows, k, n):
    """sample_bf16 draws what sample_rows draws from logits_bf16's logits, every row: greedy rows beside sampled
    ones, each filter alone, all of them, none; a NaN row takes its first NaN as the argmax does."""
    weight, packed = _packed(n, k, rows)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(rows, k, generator=g) * 3).to(BF)
    x[rows // 2, 1] = float("nan")
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[::4] = 0.0
    top_k = torch.randint(0, 50, (rows,), generator=g)
    top_p = torch.rand(rows, generator=g).clamp(min=0.2)
    min_p = torch.rand(rows, generator=g) * 0.2
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    logits = cpu_logits.logits_bf16(x, packed, weight, REFINE_TOP)
    for filters in [(None, None, None), (top_k, None, None), (None, top_p, None), (None, None, min_p),
                    (top_k, top_p, min_p)]:
        fused = cpu_logits.sample_bf16(x, packed, weight, REFINE_TOP, temperature, *filters, u)
        assert torch.equal(fused, cpu_sampling.sample_rows(logits, temperature, *filters, u))
    assert fused[rows // 2] == 0 and (rows == 1 or fused.unique().numel() > 1)


@pytest.mark.parametrize("rows, k, n", [(1, 576, 49152), (61, 576, 49152), (300, 96, 5003), (7, 64, 1001)])
def test_fp32_greedy_is_the_argmax_of_the_whole_linear(rows, k, n):
    """greedy_f32 takes torch's argmax of linear_f32's outputs, computed a vocabulary chunk at a time (300 rows of
    5003 outputs: several chunks): equal outputs the first, a NaN output (a later chunk's) the row's token."""
    g = torch.Generator().manual_seed(n + rows)
    weight = torch.randn(n, k, generator=g) * 0.05
    weight[n - 3] = weight[n - 7]  # two equal outputs in every row, at the end of the vocabulary
    weight[n // 3] = weight[n // 3].abs() * 4  # most rows' maximum earlier
    packed = cpu_linears.pack_linear(weight)
    x = torch.randn(rows, k, generator=g).abs()
    if rows > 2:
        x[1] = weight[n - 7] * 40  # row 1's maximum: the tie at the end, the first of the two taken
        x[2] = 0  # every output 0: the first id
    want = argmax_rows(cpu_linears.linear_f32(x, packed, n))
    assert torch.equal(cpu_logits.greedy_f32(x, packed, n), want)
    assert rows <= 2 or (want[1] == n - 7 and want[2] == 0)
    weight[n - 2, 0] = float("nan")
    packed = cpu_linears.pack_linear(weight)
    got = cpu_logits.greedy_f32(x, packed, n)
    assert torch.equal(got, argmax_rows(cpu_linears.linear_f32(x, packed, n))) and (got == n - 2).all()


@pytest.mark.parametrize("rows, k, n", [(1, 576, 49152), (66, 576, 49152), (300, 96, 5003), (9, 63, 1001)])
def test_screened_fp32_greedy_is_greedy_f32(rows, k, n):
    """greedy_f32_screened gives greedy_f32's tokens: outputs bf16 cannot tell apart decided in fp32 (equal ones by
    the first), rows the screen cannot bound (every output equal, NaN, infinite, too large) by greedy_f32; the
    screen's norms at least the weight's (odd k: the screen on the widening kernel)."""
    g = torch.Generator().manual_seed(n + rows)
    weight = torch.randn(n, k, generator=g) * 0.05
    weight[n // 3] = weight[n // 3].abs() * 4  # most rows' maximum earlier
    weight[n - 3] = weight[n - 7]  # two equal outputs
    weight[n // 2] = weight[n // 2].abs() * 8
    weight[n // 2 + 1] = weight[n // 2] * (1 + 2**-12)  # the same in bf16, larger in fp32 on positive rows
    # 30 more outputs closer than bf16 tells apart, which rows 7 to 36 aim at: the screen's order is not fp32's
    weight[n // 2 + 2:n // 2 + 32] = weight[n // 2] * (1 + 2**-9 * torch.randn(30, k, generator=g))
    packed = cpu_linears.pack_linear(weight)
    screen = cpu_logits.lm_screen(packed, n, k)
    assert screen is not None and (screen[1].double() >= torch.linalg.vector_norm(weight.double(), dim=1)).all()
    x = torch.randn(rows, k, generator=g).abs()
    if rows > 6:
        x[1] = weight[n - 7] * 40  # the tie at the end: the first of the two
        x[2] = 0  # every output 0: past the screen's list, the first id
        x[3] = weight[n // 2] * 40  # one of the outputs bf16 cannot tell apart
        x[4, 0], x[5, 0], x[6] = float("nan"), float("inf"), x[6] * 1e31
        x[7:37] = weight[n // 2] * 40 * (1 + 0.01 * torch.randn(x[7:37].shape, generator=g))
    want = cpu_logits.greedy_f32(x, packed, n)
    assert torch.equal(cpu_logits.greedy_f32_screened(x, screen, packed, n), want)
    assert rows <= 6 or (want[1:3].tolist() == [n - 7, 0] and n // 2 < want[3] < n // 2 + 32)
    if rows > 36:  # the screen's own argmax is not the token on some of rows 7 to 36
        bf16_argmax = argmax_rows(cpu_linears.linear_bf16(x.to(BF), screen[0], n).float())
        assert (bf16_argmax != want)[7:37].any()
    assert torch.equal(want, argmax_rows(cpu_linears.linear_f32(x, packed, n)))


@pytest.fixture(autouse=True)
def measured_here(monkeypatch):
    """The fused paths on this CPU's kernel too, measured or not (their exactness holds on every kernel)."""
    monkeypatch.setattr(cpu_logits, "MEASURED_KERNELS", (cpu_linears.bf16_kernel(),))
    monkeypatch.setattr(cpu_logits, "SAMPLED_MEASURED_KERNELS", (cpu_linears.bf16_kernel(),))
    monkeypatch.setattr(cpu_logits, "F32_MEASURED_KERNELS", (cpu_linears.bf16_kernel(),))
    monkeypatch.setattr(cpu_logits, "SCREEN_MEASURED_KERNELS", (cpu_linears.bf16_kernel(),))


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path):
    # no prefix cache: a second run of the same prompts would prefill only their tails, other bf16 sums
    return LLM(str(smollm2_path), dtype="bfloat16", device="cpu", kv_cache_memory="64MiB", enable_prefix_caching=False)


def test_greedy_tokens_are_the_argmax_of_compute_logits(smollm2_bf16):
    """On the real model's lm_head (49152 x 576): hidden states of a real forward and random ones, every row's
    token the unfused argmax, at row counts on the few-row copy; past it (oneDNN's call) the model declines."""
    model = smollm2_bf16.engine.runner.model
    hidden = torch.randn(cpu_linears.SMALL_ROWS, 576, generator=torch.Generator().manual_seed(0)).to(BF) * 2
    hidden[0] = 0  # every logit 0: the first id
    for rows in (1, 2, 9, cpu_linears.SMALL_ROWS):
        tokens = model.greedy_tokens(hidden[:rows])
        if tokens is None:  # a lm_head off the panels: nothing to compare
            assert model.lm_head.panels_for(rows) is None
            continue
        assert torch.equal(tokens, argmax_rows(model.compute_logits(hidden[:rows])))
    assert tokens is None or tokens[0] == 0
    if type(model.lm_head).__name__ == "OneDNNLinear":
        assert model.greedy_tokens(torch.zeros(cpu_linears.SMALL_ROWS + 1, 576, dtype=BF)) is None
    hidden[1, 3] = float("nan")
    assert model.greedy_tokens(hidden[:2]) is None  # compute_logits' argmax takes a NaN as its largest
    cpu_logits.MEASURED_KERNELS = ()  # a kernel the path was not measured on (the fixture puts it back)
    assert model.greedy_tokens(hidden[2:4]) is None


def test_compute_logits_in_one_call_has_the_unfused_bits(smollm2_bf16, monkeypatch):
    """Where greedy_tokens' path holds, compute_logits' lm_head, widening and refinement run as one C call
    (logits_bf16): the same bits as the three calls (NaN rows included), at row counts on the few-row copy."""
    model = smollm2_bf16.engine.runner.model
    hidden = torch.randn(cpu_linears.SMALL_ROWS, 576, generator=torch.Generator().manual_seed(1)).to(BF) * 2
    hidden[1, 3] = float("nan")
    calls = []
    fused = cpu_logits.logits_bf16
    monkeypatch.setattr(cpu_logits, "logits_bf16", lambda *a: calls.append(a[0].shape[0]) or fused(*a))
    got = {rows: model.compute_logits(hidden[:rows]) for rows in (1, 2, 9, cpu_linears.SMALL_ROWS)}
    assert calls == [1, 2, 9, cpu_linears.SMALL_ROWS] or model.lm_head.panels_for(1) is None
    monkeypatch.setattr(CausalLM, "greedy_head", lambda self, rows: None)
    for rows, logits in got.items():
        want = model.compute_logits(hidden[:rows])
        assert logits.dtype == want.dtype == torch.float32
        assert torch.equal(logits.view(torch.int32), want.view(torch.int32))


def test_greedy_generation_unchanged_and_takes_the_fused_path(smollm2_bf16, monkeypatch):
    """Greedy chat answers with the fused path and with it off (CausalLM.greedy_tokens declining): token for
    token the same; the fused path served the decode steps."""
    from test_real_model import QUESTIONS, chat_text

    llm = smollm2_bf16
    prompts = [chat_text(llm.get_tokenizer(), q) for q in QUESTIONS[:12]]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    calls = []
    greedy = cpu_logits.greedy_bf16
    monkeypatch.setattr(cpu_logits, "greedy_bf16", lambda *a: calls.append(a[0].shape[0]) or greedy(*a))
    native = llm.engine.runner.model.native_layers
    if native is not None:  # the native forward finds the tokens in its own call
        run_greedy = native.run_greedy

        def counted(input_ids, *a):
            got = run_greedy(input_ids, *a)
            if got is not None and got[1] is not None:
                calls.append(input_ids.shape[0])
            return got

        monkeypatch.setattr(native, "run_greedy", counted)
    host = llm.engine.runner.host_decode
    if host is not None:  # its greedy decode steps, planned as host arrays
        run_host = host.run

        def counted_host(seqs, *a):
            got = run_host(seqs, *a)
            if got is not None:
                calls.append(len(seqs))
            return got

        monkeypatch.setattr(host, "run", counted_host)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.runner.model.lm_head.panels_for(1) is not None  # the panels, or oneDNN's few-row copy
    assert len(calls) >= 40
    monkeypatch.setattr(CausalLM, "greedy_tokens", lambda self, hidden: None)
    unfused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert fused == unfused


def test_sampled_generation_unchanged_and_takes_the_fused_path(smollm2_bf16, monkeypatch):
    """Seeded sampled chat answers (temperature with top-p, top-k with min-p, greedy rows beside them) with the
    sampled rows drawn in the lm_head's call and with it off (CausalLM.sampled_tokens declining): token for token
    the same; the fused path served the decode steps. Logprobs or penalties keep the whole logits."""
    from test_real_model import QUESTIONS, chat_text

    llm = smollm2_bf16
    prompts = [chat_text(llm.get_tokenizer(), q) for q in QUESTIONS[:12]]
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=i) if i % 3 == 0 else
              SamplingParams(max_tokens=40, temperature=1.2, top_k=20, min_p=0.05, seed=i) if i % 3 == 1 else
              SamplingParams(max_tokens=40, temperature=0.0) for i in range(len(prompts))]
    calls = []
    fused = cpu_logits.sample_bf16
    monkeypatch.setattr(cpu_logits, "sample_bf16", lambda *a: calls.append(a[0].shape[0]) or fused(*a))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert len(calls) >= 30
    calls.clear()
    with_logprobs = [SamplingParams(max_tokens=4, temperature=0.8, seed=1, logprobs=2),
                     SamplingParams(max_tokens=4, temperature=0.8, seed=1, repetition_penalty=1.2)]
    llm.generate(prompts[:2], with_logprobs)
    assert calls == []
    monkeypatch.setattr(CausalLM, "sampled_tokens", lambda *a: None)
    assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_fp32_greedy_generation_unchanged_and_takes_the_fused_path(tiny_llama_path, monkeypatch):
    """An fp32 model on the panels: greedy answers the same token for token through the lm_head's bf16 screen
    (greedy_f32_screened, which served the decode steps), with the lm_head's argmax found a chunk of the vocabulary
    at a time (greedy_f32) and with both off; without a measured screen none is kept."""
    from batchrun.model.layers.linear import PackedLinear

    monkeypatch.setenv("BATCHRUN_F32_LINEAR", "1")
    llm = LLM(str(tiny_llama_path), dtype="float32", device="cpu", kv_cache_memory="16MiB")
    model = llm.engine.runner.model
    assert type(model.lm_head) is PackedLinear and model.lm_screen is not None
    prompts = ["the cat sat on the mat and then " * 3, "hello there", "one two three four five six", "x"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    calls = []
    for name in ("greedy_f32", "greedy_f32_screened"):
        kernel = getattr(cpu_logits, name)
        monkeypatch.setattr(cpu_logits, name, lambda *a, kernel=kernel, name=name: calls.append(name) or kernel(*a))
    screened = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert calls.count("greedy_f32_screened") >= 20 and "greedy_f32" not in calls
    screen, model.lm_screen = model.lm_screen, None
    assert screened == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert "greedy_f32" in calls
    monkeypatch.setattr(cpu_logits, "F32_MEASURED_KERNELS", ())
    assert screened == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(cpu_logits, "SCREEN_MEASURED_KERNELS", ())
    assert model.lm_screen_bytes() == 0 and screen[0].numel() * 2 + screen[1].numel() * 4 > 0
