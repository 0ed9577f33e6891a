"""The C attention kernel through TorchBackend: every query row of a step in one call.

Two properties: (1) a row's output is bit for bit the same however the step that computes it looks
(full prefill, a chunk of a chunked prefill, after a prefix-cache hit, as a decode, next to other sequences,
on one thread or two): batch invariance for attention; (2) mixed decode + prefill steps agree with
the torch path (`store_kv_torch` + SDPA) within rounding.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import pytest
import torch

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import attention as cpu_attention
from batchrun.model.layers.attention import AttentionMetadata, TorchBackend

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler (cc) to build the kernels")

BF = torch.bfloat16
KERNEL = TorchBackend(cpu_kernels=True)  # batch invariant: on a CPU with AMX, every bf16 row on AMX tiles
# bf16's default (not batch invariant): on a CPU with AMX, prefill tiles on AMX, decode rows on the vector kernel
PREFILL_AMX = TorchBackend(cpu_kernels=True, batch_invariant=False)
# bf16 not run batch invariant: prefill rows to SDPA, decode rows to the kernel (backends.select_backend)
SPLIT = TorchBackend(cpu_kernels=True, sdpa_prefill=True)
REFERENCE = TorchBackend(cpu_kernels=False)


@dataclass
class Seq:
    """A sequence's tokens (q, k, v per position, fixed whatever step computes them) and its block table."""

    q: torch.Tensor  # [L, Hq, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor
    blocks: list[int] = field(default_factory=list)


def make_seq(length: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> Seq:
    g = torch.Generator().manual_seed(seed)
    return Seq(*(torch.randn(length, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)))


def run_step_(backend: TorchBackend, cache: torch.Tensor, step: list[tuple[Seq, int, int]], window: int = 0,
             softcap: float = 0.0) -> list[torch.Tensor]:
    """One forward over `step`: (sequence, first new position, end) each, decodes (one new token) first as the
    runner orders them. Returns each entry's output rows [end - start, Hq, D], in the order given."""
    bs = cache.shape[2]
    order = sorted(range(len(step)), key=lambda i: step[i][2] - step[i][1] != 1)
    step = [step[i] for i in order]
    q = torch.cat([s.q[a:b] for s, a, b in step])
    k = torch.cat([s.k[a:b] for s, a, b in step])
    v = torch.cat([s.v[a:b] for s, a, b in step])
    slots = [s.blocks[p // bs] * bs + p % bs for s, a, b in step for p in range(a, b)]
    width = max(len(s.blocks) for s, _, _ in step)
    tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s, _, _ in step], dtype=torch.int32)
    qlens, slens = [b - a for _, a, b in step], [b for _, _, b in step]
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
        seq_lens=torch.tensor(slens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_decodes=sum(1 for n in qlens if n == 1), max_query_len=max(qlens), max_seq_len=max(slens),
        seq_lens_host=slens, query_lens_host=qlens,
    )
    out = backend.forward(q, k, v, cache, meta, q.shape[-1] ** -0.5, window=window, softcap=softcap)
    rows = [out[starts[i] : starts[i + 1]] for i in range(len(step))]
    return [rows[order.index(i)] for i in range(len(step))]


run_step = run_step_


def place(seqs: list[Seq], length: int, bs: int, num_blocks: int, seed: int, shared: int = 0) -> None:
    """Give each sequence its own random physical blocks (the first `shared` blocks of seqs[1] are seqs[0]'s:
    a prefix-cache hit)."""
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    for i, s in enumerate(seqs):
        n = (length + bs - 1) // bs
        s.blocks = [free.pop() for _ in range(n)]
        if i == 1 and shared:
            s.blocks[:shared] = seqs[0].blocks[:shared]


@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("hq,hkv,d,bs,window,softcap", [(9, 3, 64, 8, 0, 0.0), (4, 4, 128, 16, 0, 0.0),
                                                        (9, 3, 64, 8, 13, 0.0), (4, 2, 128, 16, 30, 5.0)],
                         ids=["gqa3", "mha", "gqa3-window13", "gqa2-window30-softcap"])
def test_a_rows_attention_is_bitwise_the_same_whatever_the_step(dtype, hq, hkv, d, bs, window, softcap):
    length, chunk = 45, 19  # the row checked: the last token; chunk 2 covers [19, 45)
    run_step = functools.partial(run_step_, window=window, softcap=softcap)
    new = lambda seed: make_seq(length, hq, hkv, d, dtype, seed)  # noqa: E731
    cache = lambda: torch.zeros(2, 64, bs, hkv, d, dtype=dtype)  # noqa: E731
    a = new(0)
    results = {}

    # (a) a full prefill, alone
    place([a], length, bs, 64, seed=1)
    results["full prefill"] = run_step(KERNEL, cache(), [(a, 0, length)])[0]

    # (b) chunk 2 of a chunked prefill, elsewhere in the pool, next to a decode and another prefill
    c, e = new(2), new(3)
    place([a, c, e], length, bs, 64, seed=2)
    pool = cache()
    run_step(KERNEL, pool, [(a, 0, chunk), (c, 0, 30)])
    run_step(KERNEL, pool, [(c, 30, 31), (e, 0, 7)])
    results["chunk 2"] = torch.cat([torch.zeros(chunk, hq, d, dtype=dtype),
                                    run_step(KERNEL, pool, [(c, 31, 32), (a, chunk, length), (e, 7, 12)])[1]])

    # (c) decode steps: the prefix prefilled, then one token a step beside other decodes of other lengths
    place([a, c, e], length, bs, 64, seed=3)
    pool = cache()
    run_step(KERNEL, pool, [(a, 0, length - 3), (c, 0, 5), (e, 0, 40)])
    decoded = [run_step(KERNEL, pool, [(a, p, p + 1), (c, 5 + i, 6 + i), (e, 40 + i, 41 + i)])[0]
               for i, p in enumerate(range(length - 3, length))]
    results["decode"] = torch.cat([torch.zeros(length - 3, hq, d, dtype=dtype), *decoded])

    # (d) after a prefix-cache hit: the first two blocks are another sequence's, computed in an earlier step
    twin = Seq(a.q, a.k, a.v)
    place([twin, a], length, bs, 64, seed=4, shared=2)
    pool = cache()
    run_step(KERNEL, pool, [(twin, 0, 2 * bs)])
    results["prefix hit"] = torch.cat([torch.zeros(2 * bs, hq, d, dtype=dtype),
                                       run_step(KERNEL, pool, [(a, 2 * bs, length)])[0]])

    # (e) a full prefill among many sequences of other lengths, on one thread instead of two
    others = [new(10 + i) for i in range(6)]
    place([a, *others], length, bs, 64, seed=5)
    pool = cache()
    run_step(KERNEL, pool, [(s, 0, 3 + 7 * i) for i, s in enumerate(others[:3])])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = [(s, 3 + 7 * i, 4 + 7 * i) for i, s in enumerate(others[:3])]
        step += [(others[3], 0, 44), (a, 0, length), (others[4], 0, 1), (others[5], 0, 16)]
        results["crowded, 1 thread"] = run_step(KERNEL, pool, step)[4]
    finally:
        torch.set_num_threads(threads)

    ref = results.pop("full prefill")
    assert ref.float().abs().sum() > 0
    for name, got in results.items():
        first = {"chunk 2": chunk, "decode": length - 3, "prefix hit": 2 * bs}.get(name, 0)
        assert torch.equal(got[first:], ref[first:]), name


def close_bf16(got: torch.Tensor, ref: torch.Tensor, ulps: float = 1.5) -> bool:
    err = (got.float() - ref.float()).abs()
    return bool((err <= ulps * 2.0**-8 * (ref.float().abs() + 0.05)).all())


@pytest.mark.parametrize("backend", [KERNEL, PREFILL_AMX, SPLIT], ids=["kernel", "kernel-prefill-amx", "sdpa-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (4, 4, 64, 8), (8, 2, 128, 8), (4, 4, 128, 16),
                                         (6, 2, 80, 16), (4, 2, 40, 8)])
def test_mixed_steps_match_the_torch_path(dtype, hq, hkv, d, bs, backend):
    rng = random.Random(hq * 1000 + d + bs)
    seqs = []
    for i in range(rng.randint(1, 4)):  # decodes: one new token after a cached context
        n = rng.randint(1, 150)
        seqs.append((make_seq(n, hq, hkv, d, dtype, 100 + i), n - 1, n))
    for i in range(rng.randint(1, 3)):  # prefills and extends: new tokens after 0 or more cached ones
        n, cached = rng.randint(1, 120), rng.choice([0, 0, 5, 37])
        seqs.append((make_seq(cached + n, hq, hkv, d, dtype, 200 + i), cached, cached + n))
    place([s for s, _, _ in seqs], 200, bs, 256, seed=7)
    # the cached context as an earlier step left it (written by the torch path in both pools)
    pool = torch.zeros(2, 256, bs, hkv, d, dtype=dtype)
    history = [(s, 0, a) for s, a, _ in seqs if a > 0]
    if history:
        run_step(REFERENCE, pool, history)
    ref_pool = pool.float() if dtype == BF else pool.clone()
    got = run_step(backend, pool, seqs)
    fp32 = lambda s: Seq(s.q.float(), s.k.float(), s.v.float(), s.blocks)  # noqa: E731
    ref = run_step(REFERENCE, ref_pool, [(fp32(s), a, b) for s, a, b in seqs])
    for (_s, a, b), x, y in zip(seqs, got, ref):
        assert x.dtype == dtype and x.shape == (b - a, hq, d)
        if dtype == BF:
            if backend is not SPLIT or a == b - 1:  # the kernel's rows (a decode row is the kernel's on all)
                assert close_bf16(x, y), (a, b, (x.float() - y).abs().max())
            else:  # SDPA's bf16 path rounds its probabilities to bf16 before P.V: its own accuracy, not ours
                assert torch.allclose(x.float(), y, atol=1e-2, rtol=2e-2), (a, b, (x.float() - y).abs().max())
        else:
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-5), (a, b, (x - y).abs().max())


@pytest.mark.parametrize("backend", [KERNEL, PREFILL_AMX, SPLIT], ids=["kernel", "kernel-prefill-amx", "sdpa-prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("hq,hkv,d,bs,window,softcap", [(9, 3, 64, 16, 40, 0.0), (8, 2, 128, 8, 0, 20.0),
                                                        (4, 2, 64, 8, 67, 50.0), (6, 2, 80, 16, 1, 0.0)])
def test_sliding_window_and_softcap_match_the_torch_path(dtype, hq, hkv, d, bs, window, softcap, backend):
    """Gemma's attention: a sliding window shorter than the contexts (1: each row sees itself only), the scores
    soft-capped, alone and together; decode and prefill rows of one step, against the torch path."""
    rng = random.Random(hq * 1000 + d + bs + window)
    seqs = []
    for i in range(3):  # decodes
        n = rng.randint(1, 150)
        seqs.append((make_seq(n, hq, hkv, d, dtype, 100 + i), n - 1, n))
    for i, cached in enumerate((0, 37, 90)):  # prefills and extends crossing the window
        n = rng.randint(20, 110)
        seqs.append((make_seq(cached + n, hq, hkv, d, dtype, 200 + i), cached, cached + n))
    place([s for s, _, _ in seqs], 200, bs, 256, seed=7)
    pool = torch.zeros(2, 256, bs, hkv, d, dtype=dtype)
    run_step(REFERENCE, pool, [(s, 0, a) for s, a, _ in seqs if a > 0])
    ref_pool = pool.float() if dtype == BF else pool.clone()
    got = run_step(backend, pool, seqs, window, softcap)
    fp32 = lambda s: Seq(s.q.float(), s.k.float(), s.v.float(), s.blocks)  # noqa: E731
    ref = run_step(REFERENCE, ref_pool, [(fp32(s), a, b) for s, a, b in seqs], window, softcap)
    for (_s, a, b), x, y in zip(seqs, got, ref):
        if dtype == BF:
            if backend is not SPLIT or a == b - 1:
                assert close_bf16(x, y), (a, b, (x.float() - y).abs().max())
            else:
                assert torch.allclose(x.float(), y, atol=1e-2, rtol=2e-2), (a, b, (x.float() - y).abs().max())
        else:
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-5), (a, b, (x - y).abs().max())
    if window:  # and the window matters: the same step without it differs
        unwindowed = run_step(REFERENCE, ref_pool, [(fp32(s), a, b) for s, a, b in seqs], 0, softcap)
        assert any(not torch.allclose(x, y, atol=1e-3) for x, y in zip(ref, unwindowed))


def test_the_backend_choice_keeps_every_row_on_the_kernel():
    """Every dtype and mode sends prefill rows to the kernel too (SDPA was slower for them inside the engine), and
    only the batch-invariant mode keeps decode rows on AMX."""
    from batchrun.kernels import cpu as cpu_kernels
    from batchrun.model.layers.backends import select_backend

    cpu = torch.device("cpu")
    for dtype in (BF, torch.float32):
        for invariant in (False, True):
            backend = select_backend("torch", cpu, dtype, batch_invariant=invariant)
            assert backend.cpu_kernels == cpu_kernels.available() and not backend.sdpa_prefill
            # AMX (bf16, where the CPU has it): every row when invariant, else prefill tiles only
            assert backend.amx_lanes == (1 if invariant else cpu_attention.AMX_PREFILL_LANES)
