"""The C kernels on bf16 tensors against their torch references (fp32 arithmetic, bf16 storage).

A bf16 kernel widens its inputs to fp32, accumulates in fp32 and rounds its result once to bf16; the torch
op it replaces rounds where torch's ops store. So the two agree to within a bf16 rounding or two of the
result (bf16 has 8 significant bits: a relative step of 2^-8), and exactly where both round the same fp32
value (the residual add, the KV store).
"""

import pytest
import torch
import torch.nn.functional as F

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import attention as cpu_attention
from batchrun.kernels.cpu import sampling as cpu_sampling
from batchrun.model.layers import ops
from batchrun.model.layers.attention import TorchBackend, store_kv_torch

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler (cc) to build the kernels")

KERNELS, TORCH = ops.CpuKernelOps(), ops.TorchOps()
BF = torch.bfloat16
ULP = 2.0**-8  # bf16's relative rounding step


def close(got: torch.Tensor, ref: torch.Tensor, ulps: float = 2.0) -> bool:
    """Within `ulps` bf16 steps of the reference's magnitude (plus a floor for values near zero)."""
    assert got.dtype == BF
    err = (got.float() - ref.float()).abs()
    return bool((err <= ulps * ULP * ref.float().abs() + ulps * ULP * 0.05).all())


@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 9, 3, 64), (8, 4, 4, 48), (32, 8, 1, 128), (8, 4, 2, 40)])
def test_paged_decode_bf16_matches_fp32_sdpa_of_the_same_values(bs, hq, hkv, d):
    g = torch.Generator().manual_seed(bs + hq + d)
    nb, s = 200, 8
    kv = torch.randn(2, nb, bs, hkv, d, generator=g).to(BF)
    lens = torch.tensor([1, bs, bs + 1, 2 * bs - 1, 3 * bs, 5, 70, 7 * bs + 3], dtype=torch.int32)[:s]
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.randperm(nb, generator=g)[: s * width].view(s, width).to(torch.int32)
    q = torch.randn(s, hq * d + 2 * hkv * d, generator=g).to(BF)[:, : hq * d].view(s, hq, d)
    ctx = int(lens.max())
    kk, vv = TorchBackend._gather(kv.float(), tables, ctx)
    mask = (torch.arange(ctx)[None, :] < lens[:, None]).view(s, 1, 1, ctx)
    ref = F.scaled_dot_product_attention(q.float().unsqueeze(2), kk, vv, attn_mask=mask, scale=d**-0.5,
                                         enable_gqa=True).squeeze(2)
    got = cpu_attention.paged_attention(q, kv, tables, torch.arange(s, dtype=torch.int32), lens, d**-0.5)
    assert got.dtype == BF and got.shape == (s, hq, d)
    assert close(got, ref, ulps=1.5), (got.float() - ref).abs().max()


def test_store_kv_bf16_is_exact():
    g = torch.Generator().manual_seed(1)
    n, hkv, d, nb, bs = 11, 2, 16, 8, 4
    qkv = torch.randn(n, (4 + 2 * hkv) * d, generator=g).to(BF)
    k = qkv[:, 4 * d : (4 + hkv) * d].view(n, hkv, d)
    v = qkv[:, (4 + hkv) * d :].view(n, hkv, d)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[3] = -1
    ref, got = torch.zeros(2, nb, bs, hkv, d, dtype=BF), torch.zeros(2, nb, bs, hkv, d, dtype=BF)
    store_kv_torch(k.contiguous(), v.contiguous(), ref, slots, has_padding=True)
    cpu_attention.store_kv(k, v, got, slots)
    assert torch.equal(got, ref) and got.float().abs().sum() > 0


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 384), (300, 576), (5, 100)])
def test_rms_norm_bf16_with_and_without_residual(rows, dim):
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, dim, generator=g).to(BF), torch.randn(rows, dim, generator=g).to(BF)
    w = (1 + 0.1 * torch.randn(dim, generator=g)).to(BF)
    assert close(KERNELS.rms_norm(x, w, 1e-5), TORCH.rms_norm(x, w, 1e-5))
    got, h = KERNELS.rms_norm(x, w, 1e-5, res.clone())
    ref, href = TORCH.rms_norm(x, w, 1e-5, res.clone())
    assert torch.equal(h, href)  # both round the same fp32 sum
    assert close(got, ref)
    # a bf16 model's fp32 residual stream (CpuKernelOps.residual_dtype): the sum is kept unrounded
    assert KERNELS.residual_dtype(BF) == torch.float32 and TORCH.residual_dtype(BF) == BF
    res32 = torch.randn(rows, dim, generator=g)
    got, h = KERNELS.rms_norm(x, w, 1e-5, res32.clone())
    ref, href = TORCH.rms_norm(x, w, 1e-5, res32.clone())
    assert h.dtype == torch.float32 and torch.equal(h, res32 + x.float()) and torch.equal(h, href)
    assert got.dtype == BF and close(got, ref)
    assert not torch.equal(h, (res32 + x.float()).to(BF).float())  # not rounded to bf16 on the way


def test_silu_mul_bf16():
    x = (torch.randn(33, 2 * 1000, generator=torch.Generator().manual_seed(2)) * 8).to(BF)
    assert close(KERNELS.silu_mul(x), TORCH.silu_mul(x))


def test_gelu_tanh_mul_bf16():
    x = (torch.randn(33, 2 * 1000, generator=torch.Generator().manual_seed(2)) * 4).to(BF)
    assert close(KERNELS.gelu_tanh_mul(x), TORCH.gelu_tanh_mul(x))


@pytest.mark.parametrize("d", [64, 40])
def test_rope_bf16_in_place_matches_fp32_rope_rounded(d):
    g = torch.Generator().manual_seed(d)
    n, h, hkv, max_pos = 13, 4, 2, 300
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g).to(BF)
    cos, sin = torch.randn(max_pos, d, generator=g), torch.randn(max_pos, d, generator=g)
    positions = torch.randint(0, max_pos, (n,), generator=g)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)
    ref_q, ref_k = TORCH.apply_rope(q.float(), k.float(), ops.Rotary(positions, cos, sin, torch.float32))
    v0 = v.clone()
    got_q, got_k = KERNELS.apply_rope(q, k, ops.Rotary(positions, cos, sin, BF))
    assert got_q.data_ptr() == qkv.data_ptr() and torch.equal(v, v0)
    assert close(got_q, ref_q, ulps=1.0) and close(got_k, ref_k, ulps=1.0)


@pytest.mark.parametrize("vocab", [49152, 37])
def test_logits_top_widens_and_finds_the_largest(vocab):
    x = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)).to(BF)
    x[3, vocab - 1] = 100.0  # the largest in the last (tail) entry
    out, top = cpu_sampling.logits_top(x, 8)
    assert torch.equal(out, x.float())
    assert torch.equal(out.gather(1, top).sort(-1).values, x.float().topk(8, dim=-1).values.sort(-1).values)
    assert (top[3] == vocab - 1).any()


def test_bf16_logits_refined_in_fp32_at_the_top():
    """Two candidates whose fp32 logits differ by less than a bf16 step: rounding ties them, the refinement
    orders them as fp32 does."""
    from batchrun.model.arch.blocks import refine_top_logits

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 64, generator=g).to(BF)
    weight = torch.randn(1000, 64, generator=g).to(BF)
    exact = hidden.float() @ weight.float().T
    logits, top = cpu_sampling.logits_top((hidden @ weight.T).contiguous(), 8)
    refine_top_logits(logits, hidden, weight, top)
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
