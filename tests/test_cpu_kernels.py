"""The C kernels against the torch paths they replace (batchrun/model/layers/ops.py, attention.py)."""

import pytest
import torch
import torch.nn.functional as F

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import attention as cpu_attention
from batchrun.model.layers import ops
from batchrun.model.layers.attention import TorchBackend, store_kv_torch

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler (cc) to build the kernels")

KERNELS, TORCH = ops.CpuKernelOps(), ops.TorchOps()


def test_fp32_and_bf16_cpu_models_get_the_kernels_chosen_once():
    from batchrun.model.layers.backends import select_backend

    cpu = torch.device("cpu")
    assert isinstance(ops.select_ops(cpu, torch.float32), ops.CpuKernelOps)
    assert isinstance(ops.select_ops(cpu, torch.bfloat16), ops.CpuKernelOps)  # bf16 is first-class
    assert type(ops.select_ops(cpu, torch.float16)) is ops.TorchOps
    assert select_backend("auto", cpu, torch.float32).cpu_kernels
    assert select_backend("torch", cpu, torch.bfloat16).cpu_kernels
    assert not select_backend("torch", cpu, torch.float16).cpu_kernels


# 64 and 128 take specialised vector code, 48 and 80 the generic vector code, 40 the plain loops
@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 6, 2, 64), (8, 4, 4, 48), (32, 8, 1, 128), (16, 12, 4, 80), (8, 4, 2, 40)])
def test_paged_decode_matches_gather_sdpa(bs, hq, hkv, d):
    g = torch.Generator().manual_seed(bs + hq + d)
    nb, s = 200, 9
    kv = torch.randn(2, nb, bs, hkv, d, generator=g)
    lens = torch.tensor([1, bs, bs + 1, 2 * bs - 1, 3 * bs, 5, 70, 100, 7 * bs + 3], dtype=torch.int32)[:s]
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.randperm(nb, generator=g)[: s * width].view(s, width).to(torch.int32)
    # q as the runner hands it over: a strided view into a wider (qkv-like) row
    q = torch.randn(s, hq * d + 2 * hkv * d, generator=g)[:, : hq * d].view(s, hq, d)
    ctx = int(lens.max())
    kk, vv = TorchBackend._gather(kv, tables, ctx)
    mask = (torch.arange(ctx)[None, :] < lens[:, None]).view(s, 1, 1, ctx)
    ref = F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, attn_mask=mask, scale=d**-0.5,
                                         enable_gqa=True).squeeze(2)
    got = cpu_attention.paged_attention(q, kv, tables, torch.arange(s, dtype=torch.int32), lens, d**-0.5)
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()


def test_exp_is_accurate_over_softmax_range():
    # one query against keys chosen so that the scores span [-80, 0]: the kernel's exp must match expf
    d, n = 64, 161
    scores = torch.linspace(-80.0, 0.0, n)
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    kv = torch.zeros(2, 1, n, 1, d)
    kv[0, 0, :, 0, 0] = scores
    kv[1, 0, :, 0, :] = torch.randn(n, d)
    got = cpu_attention.paged_attention(q, kv, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                        torch.tensor([n], dtype=torch.int32), 1.0)
    ref = torch.softmax(scores, 0) @ kv[1, 0, :, 0, :]
    assert torch.allclose(got[0, 0], ref, atol=1e-6, rtol=1e-5)


def test_store_kv_matches_index_copy_and_skips_padding():
    g = torch.Generator().manual_seed(1)
    n, hkv, d, nb, bs = 11, 2, 16, 8, 4
    qkv = torch.randn(n, (4 + 2 * hkv) * d, generator=g)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(n, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(n, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1
    ref, got = torch.zeros(2, nb, bs, hkv, d), torch.zeros(2, nb, bs, hkv, d)
    store_kv_torch(k.contiguous(), v.contiguous(), ref, slots, has_padding=True)
    cpu_attention.store_kv(k, v, got, slots)
    assert torch.equal(got, ref) and got.abs().sum() > 0


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(rows):
    g = torch.Generator().manual_seed(rows)
    x, res, w = torch.randn(rows, 384, generator=g), torch.randn(rows, 384, generator=g), torch.randn(384, generator=g)
    got = KERNELS.rms_norm(x, w, 1e-6)
    got2, h = KERNELS.rms_norm(x, w, 1e-6, res.clone())
    ref = TORCH.rms_norm(x, w, 1e-6)
    ref2, href = TORCH.rms_norm(x, w, 1e-6, res.clone())
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(h, href) and torch.allclose(got2, ref2, atol=1e-5, rtol=1e-5)


def test_silu_mul():
    x = torch.randn(33, 2 * 1000, generator=torch.Generator().manual_seed(2)) * 8
    got = KERNELS.silu_mul(x)
    assert torch.allclose(got, TORCH.silu_mul(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inter", [1000, 37])
def test_gelu_tanh_mul_and_its_rows_do_not_depend_on_the_row_count(inter):
    """GeGLU (Gemma): torch's gelu(tanh) to within rounding; and each row the bits it gets alone (torch's own op
    gives a row other bits by where it falls in the tensor: its vector and scalar tanh differ)."""
    x = torch.randn(33, 2 * inter, generator=torch.Generator().manual_seed(2)) * 4
    got = KERNELS.gelu_tanh_mul(x)
    assert torch.allclose(got, TORCH.gelu_tanh_mul(x), atol=2e-6, rtol=2e-6)
    assert all(torch.equal(KERNELS.gelu_tanh_mul(x[i : i + 1])[0], got[i]) for i in range(33))
    big = torch.randn(2, 2 * inter) * 30  # saturated tanh: exactly x (or 0) times up, no NaN
    assert KERNELS.gelu_tanh_mul(big).isfinite().all()


def test_tanh_cap_in_place_and_row_invariant():
    """Gemma 2's final logit soft-capping: cap * tanh(x / cap) to 1e-5 absolutely, and each row the bits it gets
    alone. The reference is float64: torch's fp32 tanh is off by up to 2e-3 in some processes on an AMX Xeon."""
    x = torch.randn(7, 1003, generator=torch.Generator().manual_seed(3)) * 40
    ref = torch.tanh(x.double() / 30.0) * 30.0
    from batchrun.kernels.cpu import elementwise

    got = elementwise.tanh_cap_(x.clone(), 30.0)
    assert (got.double() - ref).abs().max() < 1e-5 and got.abs().max() < 30.0
    assert all(torch.equal(elementwise.tanh_cap_(x[i : i + 1].clone(), 30.0)[0], got[i]) for i in range(7))


@pytest.mark.parametrize("d,rotary", [(64, 64), (48, 48), (64, 32), (48, 24)], ids=["64", "48", "64-half", "48-half"])
def test_rope_in_place_on_qkv_views(d, rotary):
    g = torch.Generator().manual_seed(d)
    n, h, hkv, max_pos = 13, 4, 2, 300
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g)
    cos, sin = torch.randn(max_pos, rotary, generator=g), torch.randn(max_pos, rotary, generator=g)
    rot = ops.Rotary(torch.randint(0, max_pos, (n,), generator=g), cos, sin, torch.float32)

    def views(t):
        q, k, v = t.split([h * d, hkv * d, hkv * d], dim=-1)
        return q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)

    q, k, v = views(qkv)
    v0 = v.clone()
    got_q, got_k = KERNELS.apply_rope(q, k, rot)
    assert got_q.data_ptr() == qkv.data_ptr() and torch.equal(v, v0)  # rotated in place, v untouched
    fresh = views(torch.randn(n, (h + 2 * hkv) * d, generator=torch.Generator().manual_seed(d)))
    ref_q, ref_k = TORCH.apply_rope(fresh[0], fresh[1], rot)
    assert torch.allclose(got_q, ref_q, atol=1e-5) and torch.allclose(got_k, ref_k, atol=1e-5)
