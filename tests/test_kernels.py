"""The Triton kernels against their torch references, and TritonBackend against TorchBackend.

Without CUDA the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1 before anything
imports them), which is slow: the grid below is a chosen cover of block size x head dim x GQA ratio x dtype
rather than their full product, with few heads and sequences, and small kernel tiles so that short contexts
still cross tiles and partitions. Each attention case puts the interesting context lengths side by side in
one batch: 1 token, exactly one block, a partly filled last block, and one long enough for the split path.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchrun.kernels.triton import (
    copy_blocks,
    copy_blocks_ref,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    store_kv,
    store_kv_ref,
)
from batchrun.model.layers.attention import AttentionMetadata, TorchBackend
from batchrun.model.layers.triton_backend import TritonBackend
from batchrun.model.layers.triton_backend import copy_blocks as backend_copy_blocks

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

# Small tiles so a ~100-token context crosses several key tiles and decode partitions.
PARTITION = 32
TILE = 16
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPE_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def case_id(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> str:
    return f"bs{block_size}-d{head_dim}-gqa{group}-{DTYPE_ID[dtype]}"


# Every block size, head dim (powers of two and not) and GQA ratio appears with fp32 (tight) and with at
# least one 16-bit dtype.
ATTENTION_CASES = [
    (8, 64, 1, torch.float32),
    (16, 128, 4, torch.float32),
    (32, 48, 8, torch.float32),
    (16, 96, 4, torch.float32),
    (16, 48, 1, torch.bfloat16),
    (32, 64, 4, torch.bfloat16),
    (8, 128, 8, torch.float16),
    (32, 80, 1, torch.float16),
    (8, 48, 4, torch.bfloat16),
    (32, 128, 1, torch.float32),
    (8, 96, 8, torch.bfloat16),
]


class Pool:
    """A random layer pool whose sequences own shuffled (non-contiguous) physical blocks."""

    def __init__(self, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 seq_lens: list[int], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 3  # a few blocks nobody owns
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(
            dtype=dtype, device=DEVICE)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(blocks_per_seq) + 1  # a padded column, as the runner pads block tables
        table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        self.block_tables = table.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    def slots(self, seq: int, positions: range) -> list[int]:
        table = self.block_tables[seq].tolist()
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in positions]


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def test_kernels_run_interpreted_exactly_without_cuda() -> None:
    """The CPU suite must execute the kernels, not skip them: Triton reads TRITON_INTERPRET when `@triton.jit`
    runs, i.e. when `kernels` is imported, so conftest has to set it before that."""
    from triton.runtime.interpreter import InterpretedFunction

    from batchrun.kernels.triton import decode_attention
    assert isinstance(decode_attention._decode_partition_kernel, InterpretedFunction) == (not HAS_CUDA)


@pytest.mark.parametrize(("block_size", "dtype", "input_dtype"), [
    (8, torch.float32, torch.float32),
    (16, torch.float16, torch.float16),
    (32, torch.bfloat16, torch.bfloat16),
    (16, torch.bfloat16, torch.float32),
], ids=["bs8-fp32", "bs16-fp16", "bs32-bf16", "bs16-fp32-into-bf16"])
def test_store_kv(block_size: int, dtype: torch.dtype, input_dtype: torch.dtype) -> None:
    num_kv_heads, head_dim, num_blocks = 3, 48, 6
    cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, seed=1)
    expected = cache.clone()
    # k and v as strided views of one fused projection, as the model produces them
    kv = randn(7, 2, num_kv_heads, head_dim, dtype=input_dtype, seed=2)
    k, v = kv[:, 0], kv[:, 1]
    last = num_blocks * block_size - 1
    slot_mapping = torch.tensor([0, -1, block_size - 1, block_size, last, -1, 3 * block_size + 2],
                                dtype=torch.int64, device=DEVICE)
    store_kv(k, v, cache, slot_mapping)
    store_kv_ref(k, v, expected, slot_mapping)
    if input_dtype == dtype:
        assert torch.equal(cache, expected)
    else:  # the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: allow one bf16 ulp
        torch.testing.assert_close(cache, expected, atol=0, rtol=2**-7)


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype"), ATTENTION_CASES,
                         ids=[case_id(*c) for c in ATTENTION_CASES])
def test_decode_attention(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    num_kv_heads = 1 if group == 8 else 2
    # 1 token, exactly one block, a partly filled last block, a partition boundary, and a long context.
    seq_lens = [1, block_size, 2 * block_size + 3, 2 * PARTITION, 3 * PARTITION + 5]
    pool = Pool(block_size, num_kv_heads, head_dim, dtype, seq_lens)
    q = randn(len(seq_lens), num_kv_heads * group, head_dim, dtype=dtype, seed=3)
    scale = head_dim**-0.5
    expected = paged_decode_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens, scale)
    split = paged_decode_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, scale, max(seq_lens),
                                   partition_size=PARTITION, block_n=TILE)
    torch.testing.assert_close(split, expected, **TOL[dtype])
    # the single-pass path (no partitions) on the same batch, written into a slice of a wider output
    out = torch.full((len(seq_lens) + 2, *q.shape[1:]), float("nan"), dtype=dtype, device=DEVICE)
    paged_decode_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, scale, max(seq_lens),
                           out=out[:len(seq_lens)], partition_size=128, block_n=TILE)
    torch.testing.assert_close(out[:len(seq_lens)], expected, **TOL[dtype])
    assert out[len(seq_lens):].isnan().all()


# Gemma's attention: (block size, head dim, GQA ratio, dtype, window, softcap). The windows are shorter than the
# long contexts (so whole key tiles and partitions fall before them), 1 (a row sees itself only), or longer.
WINDOW_CASES = [
    (8, 64, 2, torch.float32, 37, 0.0),
    (16, 48, 4, torch.float32, 0, 30.0),
    (8, 64, 1, torch.float32, 20, 50.0),
    (16, 64, 2, torch.bfloat16, 1, 20.0),
    (8, 80, 2, torch.float32, 500, 0.0),
]


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype", "window", "softcap"), WINDOW_CASES)
def test_decode_attention_window_softcap(block_size, head_dim, group, dtype, window, softcap) -> None:
    seq_lens = [1, block_size + 2, 2 * PARTITION, 3 * PARTITION + 5]
    pool = Pool(block_size, 2, head_dim, dtype, seq_lens)
    q = randn(len(seq_lens), 2 * group, head_dim, dtype=dtype, seed=3)
    scale = head_dim**-0.5
    expected = paged_decode_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens, scale, window, softcap)
    if window and window < 3 * PARTITION:  # entries before a window's first key tile are never read: poison them
        first = (3 * PARTITION + 5 - window) // TILE * TILE // block_size
        pool.block_tables[3, :first] = -(10**6)
    for partition_size in (PARTITION, None):
        got = paged_decode_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, scale, max(seq_lens),
                                     partition_size=partition_size, block_n=TILE, window=window, softcap=softcap)
        torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype", "window", "softcap"), WINDOW_CASES)
def test_prefill_attention_window_softcap(block_size, head_dim, group, dtype, window, softcap) -> None:
    bs = block_size
    chunks = [(0, 3 * TILE + 5), (2 * bs + 3, 21), (2 * PARTITION, 1), (bs, TILE + 3)]
    seq_lens = [c + n for c, n in chunks]
    pool = Pool(block_size, 2, head_dim, dtype, seq_lens)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = randn(starts[-1], 2 * group, head_dim, dtype=dtype, seed=5)
    scale = head_dim**-0.5
    expected = paged_prefill_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens, query_start_loc,
                                           scale, window, softcap)
    out = paged_prefill_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, query_start_loc,
                                  max(n for _, n in chunks), scale, block_m=TILE, block_n=TILE, window=window,
                                  softcap=softcap)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    if window:  # the window changes the answer where it is shorter than a row's context
        full = paged_prefill_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens, query_start_loc,
                                           scale, 0, softcap)
        assert not torch.allclose(full, expected, atol=1e-3) or window >= max(seq_lens)


def test_decode_attention_empty_sequence_gives_zeros() -> None:
    """A padding row (seq_len 0, as CUDA-graph padding may carry) must come out finite on both paths."""
    pool = Pool(8, 2, 64, torch.float32, [0, 2 * PARTITION + 1])
    q = randn(2, 4, 64, dtype=torch.float32, seed=4)
    for partition_size in (PARTITION, 128):
        out = paged_decode_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, 0.125,
                                     2 * PARTITION + 1, partition_size=partition_size, block_n=TILE)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert out[1].isfinite().all()


@pytest.mark.parametrize(("block_size", "head_dim", "group", "dtype"), ATTENTION_CASES,
                         ids=[case_id(*c) for c in ATTENTION_CASES])
def test_prefill_attention(block_size: int, head_dim: int, group: int, dtype: torch.dtype) -> None:
    num_kv_heads = 1 if group == 8 else 2
    bs = block_size
    # (cached tokens, new tokens): fresh prefill over several key tiles; extend after a partly filled block;
    # a single new token; a chunk starting on a block boundary and ending in a partial block; a fresh
    # prompt of exactly one block.
    chunks = [(0, 2 * TILE + 5), (bs + 3, 5), (2 * bs - 1, 1), (bs, TILE + 3), (0, bs)]
    seq_lens = [c + n for c, n in chunks]
    pool = Pool(block_size, num_kv_heads, head_dim, dtype, seq_lens)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    num_tokens = starts[-1] + 2  # two trailing padding rows belong to no sequence
    q = randn(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, seed=5)
    scale = head_dim**-0.5
    expected = paged_prefill_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens,
                                           query_start_loc, scale)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, query_start_loc,
                            max(n for _, n in chunks), scale, out=out, block_m=TILE, block_n=TILE)
    torch.testing.assert_close(out[: starts[-1]], expected[: starts[-1]], **TOL[dtype])
    assert out[starts[-1]:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
def test_copy_blocks(dtype: torch.dtype) -> None:
    pool = randn(3, 2, 10, 8, 2, 48, dtype=dtype, seed=6)
    expected = pool.clone()
    pairs = torch.tensor([[1, 4], [7, 2], [7, 9], [0, 5]], dtype=torch.int64, device=DEVICE)
    copy_blocks(pool, pairs)
    copy_blocks_ref(expected, pairs)
    assert torch.equal(pool, expected)
    # the backend helper takes a plain list of pairs (and an empty one) too
    backend_copy_blocks(pool, [(3, 6)])
    backend_copy_blocks(pool, [])
    copy_blocks_ref(expected, torch.tensor([[3, 6]]))
    assert torch.equal(pool, expected)


def mixed_step(block_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype):
    """One flat step: three decodes (one past the split threshold), an extend over a cached context whose
    last block is partly filled, a fresh prefill, and one padding token; the cache holds the context."""
    decode_ctx = [5, block_size - 1, 2 * PARTITION + 7]  # cached tokens before this step's one token
    prefills = [(block_size + 3, 6), (0, 11)]  # (cached, new)
    cached = decode_ctx + [c for c, _ in prefills]
    query_lens = [1] * len(decode_ctx) + [n for _, n in prefills]
    seq_lens = [c + n for c, n in zip(cached, query_lens)]
    pool = Pool(block_size, num_kv_heads, head_dim, dtype, seq_lens, seed=7)
    slot_mapping = [s for i, (c, n) in enumerate(zip(cached, query_lens)) for s in pool.slots(i, range(c, c + n))]
    num_tokens = len(slot_mapping) + 1
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping + [-1], dtype=torch.int64, device=DEVICE),
        block_tables=pool.block_tables,
        seq_lens=pool.seq_lens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        num_decodes=len(decode_ctx),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_host=seq_lens,
        query_lens_host=query_lens,
        has_padding=True,
    )
    q = randn(num_tokens, num_kv_heads * group, head_dim, dtype=dtype, seed=8)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=9)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=10)
    return q, k, v, pool.kv_cache, meta


@pytest.mark.parametrize(("block_size", "group", "dtype"),
                         [(16, 4, torch.float32), (8, 1, torch.bfloat16)], ids=["bs16-gqa4-fp32", "bs8-gqa1-bf16"])
def test_triton_backend_matches_torch_backend(block_size: int, group: int, dtype: torch.dtype) -> None:
    head_dim = 64
    q, k, v, cache, meta = mixed_step(block_size, 2, group, head_dim, dtype)
    torch_cache = cache.clone()
    backend = TritonBackend(partition_size=PARTITION, decode_block_n=TILE, prefill_block_m=TILE,
                            prefill_block_n=TILE)
    out = backend.forward(q, k, v, cache, meta, head_dim**-0.5)
    expected = TorchBackend().forward(q, k, v, torch_cache, meta, head_dim**-0.5)
    real = meta.slot_mapping.shape[0] - 1  # the padding token's output is unspecified
    torch.testing.assert_close(out[:real], expected[:real], **TOL[dtype])
    assert torch.equal(cache, torch_cache)  # same K/V stored, padding skipped


# --- CUDA only: compiled kernels at production tile sizes, and graph capture -------------------------------


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_ID.get)
def test_decode_default_tiles_cuda(dtype: torch.dtype) -> None:
    seq_lens = [1, 16, 100, 513, 1500]
    pool = Pool(16, 8, 128, dtype, seq_lens)
    q = randn(len(seq_lens), 32, 128, dtype=dtype, seed=11)
    expected = paged_decode_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens, 128**-0.5)
    out = paged_decode_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, 128**-0.5, max(seq_lens))
    torch.testing.assert_close(out, expected, **TOL[dtype])


@cuda
@needs_cuda
def test_decode_step_replays_in_cuda_graph() -> None:
    """Captured once with a generous max_seq_len, a decode step must give fresh results when replayed
    after the sequences grew (new seq_lens, new slots): nothing may be baked in at capture."""
    dtype, bs, num_seqs, max_len = torch.bfloat16, 16, 4, 1024
    num_blocks = num_seqs * max_len // bs
    cache = torch.randn(2, num_blocks, bs, 2, 64, device=DEVICE, dtype=dtype)
    tables = torch.randperm(num_blocks, device=DEVICE).view(num_seqs, -1).int()
    backend = TritonBackend()

    def fill(meta: AttentionMetadata, lens: list[int]) -> None:
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
        meta.slot_mapping.copy_(torch.tensor(slots))
        meta.seq_lens_host[:] = lens

    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE), block_tables=tables,
        seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=DEVICE), num_decodes=num_seqs,
        max_query_len=1, max_seq_len=max_len, seq_lens_host=[1] * num_seqs, query_lens_host=[1] * num_seqs,
    )
    q, k, v = (torch.randn(num_seqs, h, 64, device=DEVICE, dtype=dtype) for h in (8, 2, 2))
    fill(meta, [3, 40, 600, 1000])
    backend.forward(q, k, v, cache, meta, 0.125)  # warm-up compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, 0.125)
    for lens in ([5, 17, 70, 1024], [1, 500, 513, 2]):
        fill(meta, lens)
        graph.replay()
        expected = TorchBackend().forward(q, k, v, cache.clone(), meta, 0.125)
        torch.testing.assert_close(out, expected, **TOL[dtype])


def test_llm_greedy_tokens_match_torch_backend(tiny_llama_path) -> None:
    """End to end through the engine: the Triton backend (interpreted here) gives the torch backend's greedy
    tokens, with prefix-cache hits and partly filled last blocks in the batch."""
    from batchrun import LLM, SamplingParams

    shared = ("The old teacher walks across the bridge toward the village market before the morning, and the "
              "young farmer follows the river past the forest with his dog")
    first = [shared + " rain."]
    batch = [shared + " rain, and the farmer sees a horse.", shared + " light.", "A cat sleeps."]
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    tokens, hits = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_path), device=DEVICE.type, dtype="float32", block_size=8, num_kv_blocks=64,
                  attention_backend=backend)
        # the first request fills the prefix cache; the batch then hits it
        outs = llm.generate(first, params, use_tqdm=False) + llm.generate(batch, params, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
        hits[backend] = llm.metrics()["prefix_cache_hit_tokens"]
    assert tokens["triton"] == tokens["torch"]
    assert hits["triton"] == hits["torch"] >= 2 * 16  # two requests each reused two or more full blocks
    prompt_lens = [len(llm.tokenizer(p)["input_ids"]) for p in first + batch]
    assert any(n % 8 for n in prompt_lens)  # a partly filled last block is in play
