"""The bf16 linear for a decode step's few rows (cpu_kernels.linear_bf16_small) and where OneDNNLinear uses it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchrun.model import cpu_kernels
from batchrun.model.cpu_linear import OneDNNLinear

pytestmark = pytest.mark.skipif(not cpu_kernels.has_f32_linear(),
                                reason="needs the C kernels built for a CPU with AVX-512")


@pytest.mark.parametrize("n, k", [(960, 576), (37, 64), (49, 17), (576, 1536), (100, 3)])
def test_small_linear_is_the_fp32_sum_of_exact_bf16_products_rounded_once(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = cpu_kernels.pack_linear(w)
    for rows in (1, 3, 8, 9, 17, cpu_kernels.SMALL_ROWS):  # one row tile of 8, two, three
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        exact = x.double() @ w.double().T + bias.double()
        got = cpu_kernels.linear_bf16_small(x, packed, n, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # one rounding to bf16 (8 bits) of an fp32 sum: within 2^-8 relative, plus the fp32 sum's own error
        assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4 * k).all()
        no_bias = cpu_kernels.linear_bf16_small(x, packed, n)
        assert ((no_bias.double() - (exact - bias.double())).abs() <= (exact - bias.double()).abs() * 2**-8 + 1e-4 * k).all()
        # a row's result does not depend on the other rows of the call
        for i in range(rows):
            assert torch.equal(cpu_kernels.linear_bf16_small(x[i : i + 1], packed, n, bias)[0], got[i])


def test_onednn_linear_takes_the_small_kernel_for_a_few_rows_only_outside_the_invariant_mode(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=False).to(torch.bfloat16)
    fast, invariant = OneDNNLinear(lin), OneDNNLinear(lin, invariant=True)
    assert fast.small is not None and invariant.small is None
    calls = []
    small = cpu_kernels.linear_bf16_small
    monkeypatch.setattr(cpu_kernels, "linear_bf16_small", lambda *a: calls.append(a[0].shape[0]) or small(*a))
    for rows in (1, cpu_kernels.SMALL_ROWS, cpu_kernels.SMALL_ROWS + 1, 64):
        x = torch.randn(rows, 576).to(torch.bfloat16)
        ref = F.linear(x.float(), lin.weight.float())
        for module in (fast, invariant):
            got = module(x).float()
            assert (got - ref).abs().max() <= 2**-7 * ref.abs().max()
    assert calls == [1, cpu_kernels.SMALL_ROWS]  # the fast module's two small calls; the invariant one never
    monkeypatch.setenv("BATCHRUN_SMALL_BF16_LINEAR", "0")
    assert OneDNNLinear(lin).small is None
