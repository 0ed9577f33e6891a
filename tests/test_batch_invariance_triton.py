"""The Triton attention kernels compute a query row the same way whatever shares its step.

Under TRITON_INTERPRET=1 (no CUDA) the arithmetic is NumPy's, so these tests hold the kernels' *structure*:
which key tiles a row visits, in which order, how partitions are merged. On a GPU `tl.dot` adds one more
question (whether an MMA gives a row the same bits in a 16-row and a 64-row tile), which only a GPU run of
this file answers.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchrun.kernels.triton import paged_decode_attention, paged_prefill_attention
from batchrun.kernels.triton._common import interpreting

TILE = 16
PARTITION = 32  # a 100-token context is split into 4 partitions
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _row_invariant_interpreted_dot(monkeypatch):
    """Under the interpreter, `tl.dot` is NumPy's matmul, i.e. the host's OpenBLAS, whose sgemm kernels for
    some CPUs sum a row differently by its place in the tile (measured: OpenBLAS 0.3.31's Haswell and Zen
    kernels on an AMD EPYC, 224 of 448 rows of 16-64-row products differ from the row computed alone; its
    SkylakeX and Sandybridge kernels, none). A GPU's MMA treats every row alike, and these tests are about the
    kernels' structure, not the host BLAS: so here the interpreted dot sums in float64 (fp32 products are exact
    there) and rounds once, which gives a row the same bits wherever it sits."""
    if not interpreting():
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    original = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _pool(seq_lens: list[int], block_size: int = 8, num_kv_heads: int = 2, head_dim: int = 32,
          dtype: torch.dtype = torch.float32, seed: int = 0):
    """A pool whose sequence i owns shuffled blocks; each sequence's K/V are a function of (seed, i) only, so
    the same sequence in two pools has the same context."""
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(seq_lens))).tolist()
    table = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        ids = [order.pop() for _ in range(n)]
        table[i, :n] = torch.tensor(ids, dtype=torch.int32)
        gen = torch.Generator().manual_seed(seed * 1000 + seq_lens[i])
        kv = torch.randn(2, n, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
        cache[:, ids] = kv.to(DEVICE)
    return cache, table.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def _q(seq_len: int, num_rows: int, num_heads: int = 4, head_dim: int = 32, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 + seq_len)
    return torch.randn(num_rows, num_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(("partition_size", "ours"), [(PARTITION, 70), (PARTITION, 20), (None, 70)],
                         ids=["split", "one-partition", "unsplit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_row_does_not_depend_on_the_batch(partition_size, ours, dtype) -> None:
    """A sequence's decode output alone, and beside longer and shorter ones (the grid and the split flag then
    change), is the same bits: the partitions are a function of the sequence's own length, and a sequence of
    one partition gets the same bits through the merge (beside a longer one) as stored directly (alone)."""
    alone_cache, alone_table, alone_lens = _pool([ours], dtype=dtype)
    q = _q(ours, 1, dtype=dtype)
    alone = paged_decode_attention(q, alone_cache, alone_table, alone_lens, 0.2, ours,
                                   partition_size=partition_size, block_n=TILE)
    for others in ([20], [150, 3], [5, 9, 31]):
        lens = [*others, ours]
        cache, table, seq_lens = _pool(lens, dtype=dtype)
        qs = torch.cat([_q(n, 1, dtype=dtype) for n in lens])
        out = paged_decode_attention(qs, cache, table, seq_lens, 0.2, max(lens), partition_size=partition_size,
                                     block_n=TILE)
        assert torch.equal(out[-1:], alone), others


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unsplit_decode_equals_prefill_and_chunks(dtype) -> None:
    """Without the split, the last token of a context gets the same bits from the decode kernel, from a whole
    prefill, and from chunked prefills (a prefix-cache hit is a chunk whose context was cached)."""
    seq_len = 75
    cache, table, seq_lens = _pool([seq_len], dtype=dtype)
    q = _q(seq_len, seq_len, dtype=dtype)
    decode = paged_decode_attention(q[-1:], cache, table, seq_lens, 0.2, seq_len, partition_size=None, block_n=TILE)
    split = paged_decode_attention(q[-1:], cache, table, seq_lens, 0.2, seq_len, partition_size=PARTITION,
                                   block_n=TILE)
    for chunk in (seq_len, 40, 16, 7, 1):  # the last chunk holds the last token; its context is cached
        start = seq_len - chunk
        out = paged_prefill_attention(q[start:], cache, table, seq_lens,
                                      torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE), chunk, 0.2,
                                      block_m=TILE, block_n=TILE)
        assert torch.equal(out[-1:], decode), chunk
    torch.testing.assert_close(split, decode, atol=1e-2, rtol=1e-2)  # the split is close, not the same bits


@pytest.mark.parametrize(("window", "softcap"), [(30, 0.0), (9, 20.0)], ids=["window30", "window9-softcap"])
def test_unsplit_decode_equals_prefill_and_chunks_with_a_window(window, softcap) -> None:
    """With a sliding window each kernel starts a row at the key tile holding its window's first key (prefill:
    its tile's first row's), and a row's tiles before its own first visible key leave its sums at exactly zero:
    the decode row and every chunking of the prefill still agree bit for bit."""
    seq_len = 75
    cache, table, seq_lens = _pool([seq_len])
    q = _q(seq_len, seq_len)
    kw = dict(window=window, softcap=softcap)
    decode = paged_decode_attention(q[-1:], cache, table, seq_lens, 0.2, seq_len, partition_size=None, block_n=TILE,
                                    **kw)
    for chunk in (seq_len, 40, 16, 7, 1):
        start = seq_len - chunk
        out = paged_prefill_attention(q[start:], cache, table, seq_lens,
                                      torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE), chunk, 0.2,
                                      block_m=TILE, block_n=TILE, **kw)
        assert torch.equal(out[-1:], decode), chunk


def test_backend_split_follows_the_mode() -> None:
    from batchrun.model.layers.backends import select_backend

    assert select_backend("triton", DEVICE, torch.float32).partition_size == 512
    assert select_backend("triton", DEVICE, torch.float32, batch_invariant=True).partition_size is None
