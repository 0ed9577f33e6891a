"""The AVX2 quantized linears (csrc/quant_linears.c: tile_avx2), on this machine whatever its CPU has: the library
built a second time for x86-64-v3 (AVX2 and FMA, no AVX-512: cpu_kernels.build's march, BATCHRUN_CPU_MARCH)
and put in place of the native one for this module. On an AVX2 CPU without AVX512-VNNI that is the kernel the
engine runs; on an AVX-512 one it is otherwise never compiled.

The kernel is held to the plain C loop bit for bit (the same integer sums, the same fp32 steps per row) on shapes
that reach its tails: inputs that are not a whole number of its 16-bit chunks, outputs past the last whole panel,
every tile height, weights of -128 (int8 checkpoints may hold them; the kernel multiplies by |q| up to 128), and
to test_quant_kernels' emulation of the arithmetic."""

import dataclasses
import platform
from pathlib import Path

import pytest
import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import quant as qk
from batchrun.kernels.layouts import quant_weight as quant
from batchrun.model.quant.linear import QuantSpec, quantize_linear
from tests.test_quant_kernels import _emulate, _make


def _cpu_has_avx2() -> bool:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx2", "fma", "bmi2", "movbe"} <= set(flags)


pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_avx2(),
                                reason="needs an x86-64 CPU with AVX2 (x86-64-v3)")


@pytest.fixture(scope="module", autouse=True)
def avx2_library():
    """The library built for x86-64-v3 in place of the native one (quant.py reaches it through _library)."""
    lib = cpu_kernels.build(cpu_kernels.sources(), qk.SIGNATURES, march="x86-64-v3")
    if lib is None:
        pytest.skip("the kernels do not build here (no C compiler)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qk, "_library", lambda: lib)
        mp.delenv("BATCHRUN_QUANT_VNNI", raising=False)
        yield lib


def test_the_avx2_kernel_is_the_one_that_runs(monkeypatch):
    assert qk.kernel() == "avx2"
    monkeypatch.setenv("BATCHRUN_QUANT_VNNI", "0")  # the plain loop on request
    assert qk.kernel() == "plain"


def _with_minus_128(w: quant.QuantizedWeight) -> quant.QuantizedWeight:
    q = w.qweight.clone()
    q[0, :5] = -128
    q[-1, -3:] = -128
    q[1, ::7] = 127
    return dataclasses.replace(w, qweight=q)


CASES = [  # (bits, out, in, group): 36 = 9 k-steps, 40-input groups = 5 int4 k-steps (activation groups of 8)
    (8, 67, 128, 128), (8, 96, 256, 32), (8, 33, 36, 12), (8, 40, 200, 40),
    (4, 67, 128, 32), (4, 96, 256, 128), (4, 33, 120, 40), (4, 50, 96, 96),
]


@pytest.mark.parametrize("bits,n,k,group", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_equals_the_plain_loop_and_the_emulation(bits, n, k, group, dtype):
    gen = torch.Generator().manual_seed(n * k + group + bits)
    w = _make(bits, n, k, group, gen)
    if bits == 8:
        w = _with_minus_128(w)
    packed = qk.pack(w)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    for rows in range(1, 10):  # every tile height, and 5..9: a tile of 4 and its rest
        x = (torch.randn(rows, k, generator=gen) * 3).to(dtype)
        x[0, : min(k, 8)] = 0  # a zero stretch: quantized to zeros
        y = qk.linear(x, packed, bias)
        assert torch.equal(y, qk.linear(x, packed, bias, plain=True)), rows
        emulated = _emulate(x, w) + bias.double()
        out_round = 2**-8 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(y.double(), emulated, rtol=out_round, atol=1e-5 * emulated.abs().max().item()), rows


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [8, 64, 128])
def test_activation_groups_the_python_side_never_asks_for(bits, group_size):
    """kernel_group keeps the activation groups at 32 inputs or fewer; the kernel takes any that divides the
    weights' group (int4's 16-bit sums widen every 32 inputs)."""
    gen = torch.Generator().manual_seed(group_size + bits)
    packed = dataclasses.replace(qk.pack(_make(bits, 70, 256, 128, gen)), group_size=group_size)
    x = torch.randn(6, 256, generator=gen) * 5
    assert torch.equal(qk.linear(x, packed), qk.linear(x, packed, plain=True))


@pytest.mark.parametrize("bits,n,k,group", [(8, 67, 256, 128), (4, 67, 256, 128), (4, 40, 96, 32)])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(bits, n, k, group):
    gen = torch.Generator().manual_seed(bits + n + k)
    packed = qk.pack(_make(bits, n, k, group, gen))
    total = 150
    x = torch.randn(total, k, generator=gen).to(torch.bfloat16)
    alone = torch.cat([qk.linear(x[i : i + 1], packed) for i in range(total)])
    for rows in (2, 3, 5, 11, 70, 150):
        together = torch.cat([qk.linear(x[i : i + rows], packed) for i in range(0, total, rows)])
        assert torch.equal(together, alone), rows


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_quantized_linear_module_takes_the_avx2_kernel(fmt):
    gen = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(160, 72, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(72, 160, generator=gen) * 0.1)
    module = quantize_linear(linear, QuantSpec.parse(fmt))
    assert not module.plain
    x = torch.randn(2, 5, 160, generator=gen).to(torch.bfloat16)
    y = module(x)
    assert y.shape == (2, 5, 72)
    assert torch.equal(y.view(10, 72), qk.linear(x.view(10, 160), module.packed, module.bias, plain=True))
