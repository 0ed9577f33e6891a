"""batchrun's bf16 linear on bf16 panels (cpu_kernels.linears.linear_bf16): a decode step's few rows where oneDNN
has bf16 kernels (OneDNNLinear hands them over), every linear of a bf16 model where it has none (PackedLinear)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import OneDNNLinear, PackedLinear, own_kernel, reorder_linears

pytestmark = pytest.mark.skipif(not cpu_linears.has_panel_linears(),
                                reason="needs the C kernels built for a CPU with AVX-512, or AVX2 and FMA")
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (49, 17), (576, 1536), (100, 3)])
def test_bf16_linear_is_the_fp32_sum_of_exact_bf16_products_rounded_once(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = cpu_linears.pack_linear(w)
    # one row tile, several, a few-row step's most, and prefill sizes (chunks of rows, k in slices at k = 1536)
    for rows in (1, 3, 8, 9, 17, cpu_linears.SMALL_ROWS, 70, 301):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T + bias.double()
        got = cpu_linears.linear_bf16(x, packed, n, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # one rounding to bf16 (8 bits) of an fp32 sum: within 2^-8 relative, plus the fp32 sum's own error
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4 * k).all()
        no_bias = cpu_linears.linear_bf16(x, packed, n)
        assert ((no_bias.double() - (exact - bias.double())).abs() <= (exact - bias.double()).abs() * 2**-8 + 1e-4 * k).all()
        # a row's result does not depend on the other rows of the call
        for i in range(0, rows, max(1, rows // 12)):
            assert torch.equal(cpu_linears.linear_bf16(x[i : i + 1], packed, n, bias)[0], got[i])


def test_a_prefill_call_in_several_row_chunks_and_k_spans_keeps_each_rows_bits():
    """Past a row chunk's rows (AMX: 512, taken in equal chunks), with k in several spans and a thread's panels in
    several groups: each row's outputs are the ones it gets alone or in a smaller call (AMX: under 16 rows on tiles
    of their own rows, up to 128 read in place, more copied into tile order), within one bf16 rounding of the exact
    sum."""
    n, k, rows = 960, 1536, 1100
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    packed = cpu_linears.pack_linear(w)
    got = cpu_linears.linear_bf16(x, packed, n, bias)
    exact = x.double() @ w.double().T + bias.double()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4 * k).all()
    for start, count in ((0, 1), (511, 2), (700, 16), (40, 100), (1099, 1), (300, 513)):
        part = cpu_linears.linear_bf16(x[start : start + count].contiguous(), packed, n, bias)
        assert torch.equal(part, got[start : start + count]), (start, count)


@pytest.mark.skipif(not ONEDNN_BF16, reason="needs oneDNN's bf16 kernels (a CPU with AVX512-BF16 or AMX)")
def test_onednn_linear_takes_the_small_kernel_for_a_few_rows_only_outside_the_invariant_mode(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=False).to(torch.bfloat16)
    fast, invariant = OneDNNLinear(lin), OneDNNLinear(lin, invariant=True)
    assert fast.small is not None and invariant.small is None
    calls = []
    small = cpu_linears.linear_bf16
    monkeypatch.setattr(cpu_linears, "linear_bf16", lambda *a: calls.append(a[0].shape[0]) or small(*a))
    for rows in (1, cpu_linears.SMALL_ROWS, cpu_linears.SMALL_ROWS + 1, cpu_linears.SMALL_ROWS + 40):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        ref = F.linear(x.float(), lin.weight.float())
        for module in (fast, invariant):
            got = module(x).float()
            assert (got - ref).abs().max() <= 2**-7 * ref.abs().max()
    assert calls == [1, cpu_linears.SMALL_ROWS]  # the fast module's two small calls; the invariant one never
    monkeypatch.setenv("BATCHRUN_SMALL_BF16_LINEAR", "0")
    assert OneDNNLinear(lin).small is None


@pytest.mark.skipif(ONEDNN_BF16, reason="needs a CPU where oneDNN has no bf16 kernels (no AVX512-BF16 or AMX)")
def test_a_bf16_model_without_onednn_bf16_runs_every_linear_on_the_panels():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed_tokens = nn.Embedding(50, 64).to(torch.bfloat16)
    model.proj = nn.Linear(64, 96).to(torch.bfloat16)
    model.lm_head = nn.Linear(64, 50, bias=False).to(torch.bfloat16)
    model.lm_head.weight = model.embed_tokens.weight  # tied: the lm_head gets a packed copy, the embedding keeps its own
    x = torch.randn(5, 64).to(torch.bfloat16)
    refs = [F.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float())
            for m in (model.proj, model.lm_head)]
    assert own_kernel(model)
    assert reorder_linears(model) == 2
    assert isinstance(model.proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.embed_tokens.weight.shape == (50, 64)
    for module, ref in zip((model.proj, model.lm_head), refs):
        got = module(x)
        assert got.dtype == torch.bfloat16
        assert (got.float() - ref).abs().max() <= 2**-7 * ref.abs().max()


def test_the_start_log_names_the_kernel_each_class_of_linear_takes():
    """linear_kernels (logged when the engine packs its linears): every class by its attribute name, under the
    kernel own_kernel chose for the model; a bf16 linear on AMX tiles only where its k is a multiple of 32."""
    from batchrun.model.layers.linear import linear_kernels

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
            self.down_proj = nn.Linear(80, 64, bias=False, dtype=torch.bfloat16)  # k not a multiple of 32

    model = nn.Sequential(Layer(), Layer())
    kinds = linear_kernels(model)
    assert sorted(name for names in kinds.values() for name in names) == ["down_proj", "q_proj"]
    if not own_kernel(model):
        assert all(kernel.startswith("oneDNN") for kernel in kinds)
    elif cpu_linears.bf16_kernel() == "amx":
        assert kinds == {"batchrun's panels on AMX tiles": ["q_proj"], "batchrun's panels on vdpbf16ps": ["down_proj"]}
    assert set(linear_kernels(model, batch_invariant=True)) <= {
        "batchrun's panels on AMX tiles", "batchrun's panels on vdpbf16ps", "batchrun's panels (widened to fp32)"}
