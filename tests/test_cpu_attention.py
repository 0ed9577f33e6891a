"""The C decode-attention kernel against the torch gather + SDPA path."""

import pytest
import torch
import torch.nn.functional as F

from batchrun.model import cpu_attention
from batchrun.model.attention import TorchBackend

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="needs a C compiler (cc) to build the kernel")


@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 6, 2, 64), (8, 4, 4, 48), (32, 8, 1, 128), (16, 12, 4, 80)])
def test_matches_gather_sdpa(bs, hq, hkv, d):
    g = torch.Generator().manual_seed(bs + hq + d)
    nb, s = 200, 9
    kv = torch.randn(2, nb, bs, hkv, d, generator=g)
    lens = torch.tensor([1, bs, bs + 1, 2 * bs - 1, 3 * bs, 5, 70, 100, 7 * bs + 3], dtype=torch.int32)[:s]
    width = int((lens.max() + bs - 1) // bs)
    tables = torch.randperm(nb, generator=g)[: s * width].view(s, width).to(torch.int32)
    q = torch.randn(s, hq, d, generator=g)
    ctx = int(lens.max())
    kk, vv = TorchBackend._gather(kv, tables, ctx)
    mask = (torch.arange(ctx)[None, :] < lens[:, None]).view(s, 1, 1, ctx)
    ref = F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, attn_mask=mask, scale=d**-0.5,
                                         enable_gqa=True).squeeze(2)
    got = cpu_attention.paged_decode(q, kv, tables, lens, ctx, d**-0.5)
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5)
