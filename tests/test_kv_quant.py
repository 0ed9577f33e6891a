"""The int8 KV cache (`kv_cache_dtype: int8`, batchrun/kernels/layouts/kv_rows.py).

The format (a row's values within half a step, the C store's bytes equal to the torch store's), the C kernel
against the torch reference on int8 pools (GQA, sliding windows, soft-capping, several and partial blocks,
decode and prefill rows, fp32 and bf16 queries), a row's bits whatever its step, swaps and block copies keeping
values and scales, and whole engine runs: the pool holds more tokens in the same memory, greedy tokens agree
with the unquantized engine, batch invariance holds with swap preemption and chunked prefill.
"""

from __future__ import annotations

import functools
import platform
import random

import pytest
import torch
from test_batch_invariance import TARGET_PARAMS, _generate, _others, _prompts
from test_cpu_attention import Seq, close_bf16, make_seq, place, run_step_

from batchrun import LLM, SamplingParams
from batchrun.engine.contract import ScheduledSeq, SchedulerOutput
from batchrun.engine_args import EngineArgs, EngineArgsError
from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.layouts.kv_rows import as_bytes, dequantize, encode_rows, quantize_rows, scales, to_fp8
from batchrun.model.layers.attention import TorchBackend, store_kv_torch
from batchrun.model.runner.model_runner import ModelRunner, cache_shape

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C compiler (cc) to build the kernels")
BF = torch.bfloat16
POOLS = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # the 8-bit pools
KERNEL = TorchBackend(cpu_kernels=True)
REFERENCE = TorchBackend(cpu_kernels=False)


def int8_pool(num_blocks: int, bs: int, hkv: int, d: int) -> torch.Tensor:
    return torch.zeros(2, num_blocks, bs, hkv, d + 4, dtype=torch.int8)


# ---- the format ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_a_row_comes_back_within_half_a_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 3, 64, generator=g) * torch.rand(40, 3, 1, generator=g) * 10).to(dtype)
    x[5, 1] = 0  # an all-zero row: scale 0, values 0
    packed = quantize_rows(x)
    assert packed.dtype == torch.int8 and packed.shape == (40, 3, 68)
    step = scales(packed)
    assert torch.equal(step[..., 0], x.float().abs().amax(-1) * (1.0 / 127.0))
    err = (dequantize(packed) - x.float()).abs()
    assert (err <= step / 2 + x.float().abs() * 2**-22).all()  # half a step, and the fp32 product's rounding
    assert packed[..., :64].abs().amax(-1)[x.float().abs().amax(-1) > 0].eq(127).all()  # the full range is used
    assert dequantize(packed)[5, 1].eq(0).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_the_c_store_writes_the_torch_stores_bytes(dtype):
    from batchrun.kernels.cpu import attention as cpu_attention

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 3 * 2 * 48, generator=g).to(dtype)  # k and v as strided views of one fused row
    k, v = qkv[:, 96:192].view(9, 2, 48), qkv[:, 192:].view(9, 2, 48)
    slots = torch.tensor([3, 17, -1, 0, 8, 9, 30, 31, 12])
    ours, ref = int8_pool(4, 8, 2, 48), int8_pool(4, 8, 2, 48)
    cpu_attention.store_kv_int8(k, v, ours, slots)
    store_kv_torch(k, v, ref, slots, has_padding=True)
    assert torch.equal(ours, ref)
    assert ours.view(2, 32, 2, 52)[:, [3, 17, 0, 8, 9, 30, 31, 12]].abs().sum(-1).gt(0).all()


@needs_kernels
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_the_c_fp8_store_writes_the_torch_stores_bytes(kv):
    """Every bf16 value (normals, subnormals, zeros, infinities, NaNs, past the format's range) and fp32 values
    between two fp8 values (the ties included) cast to the bytes torch's clamp-and-cast gives."""
    from batchrun.kernels.cpu import attention as cpu_attention

    pool_dtype = POOLS[kv]
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF)
    grid = torch.arange(256, dtype=torch.uint8).view(pool_dtype).float()
    grid = grid[grid.isfinite()].unique()
    between = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid[1:] * 0.75 + grid[:-1] * 0.25,
                         grid.nextafter(torch.tensor(float("inf"))), grid.nextafter(torch.tensor(float("-inf")))])
    for values in (every_bf16, between):
        rows = -(-values.numel() // 64)
        x = torch.cat([values, values.new_zeros(rows * 64 - values.numel())]).view(rows, 1, 64)
        slots = torch.arange(rows)
        ours = torch.zeros(2, rows, 1, 1, 64, dtype=pool_dtype)
        ref = torch.zeros_like(ours)
        cpu_attention.store_kv_fp8(x, x.flip(0), ours, slots)
        store_kv_torch(x, x.flip(0), ref, slots)
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))


# ---- the kernels ------------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, BF])
@pytest.mark.parametrize("hq,hkv,d,bs,window,softcap", [(9, 3, 64, 16, 0, 0.0), (8, 2, 128, 8, 0, 20.0),
                                                        (4, 2, 64, 8, 37, 0.0), (6, 2, 80, 16, 1, 30.0)],
                         ids=["gqa3", "gqa4-softcap", "gqa2-window37", "window1-softcap"])
def test_the_int8_kernel_matches_the_torch_reference(dtype, hq, hkv, d, bs, window, softcap):
    """Decodes after cached contexts, prefills and extends (partial last blocks) in one step, on an int8 pool that
    both store into; the same step on the reference path, whose pool must come out with the same bytes."""
    rng = random.Random(hq * 1000 + d + bs + window)
    seqs = []
    for i in range(3):  # decodes
        n = rng.randint(1, 90)
        seqs.append((make_seq(n, hq, hkv, d, dtype, 100 + i), n - 1, n))
    for i, cached in enumerate((0, 5, 37)):  # a prefill and two extends
        n = rng.randint(1, 50)
        seqs.append((make_seq(cached + n, hq, hkv, d, dtype, 200 + i), cached, cached + n))
    place([s for s, _, _ in seqs], 100, bs, 128, seed=7)
    run = functools.partial(run_step_, window=window, softcap=softcap)
    pool = int8_pool(128, bs, hkv, d)
    history = [(s, 0, a) for s, a, _ in seqs if a > 0]
    run(REFERENCE, pool, history)
    ref_pool = pool.clone()
    got = run(KERNEL, pool, seqs)
    ref = run(REFERENCE, ref_pool, seqs)
    assert torch.equal(pool, ref_pool)
    # and the unquantized answer, to see that the int8 pool is read as what it holds
    fp32 = [(Seq(s.q.float(), s.k.float(), s.v.float(), s.blocks), a, b) for s, a, b in seqs]
    exact_pool = torch.zeros(2, 128, bs, hkv, d)
    run(REFERENCE, exact_pool, [(s, 0, a) for s, a, _ in fp32 if a > 0])
    exact = run(REFERENCE, exact_pool, fp32)
    for (_s, a, b), x, y, z in zip(seqs, got, ref, exact):
        assert x.dtype == dtype and x.shape == (b - a, hq, d)
        if dtype == BF:
            assert close_bf16(x, y, ulps=2), (a, b, (x.float() - y.float()).abs().max())
        else:
            assert torch.allclose(x, y, atol=2e-6, rtol=1e-5), (a, b, (x - y).abs().max())
        assert (x.float() - z).abs().max() < 0.05, (a, b, (x.float() - z).abs().max())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_a_rows_int8_attention_is_bitwise_the_same_whatever_the_step(dtype):
    """The last 12 rows of one sequence: in a full prefill alone; as chunk 2 next to other sequences; as decodes
    beside others, on one thread."""
    hq, hkv, d, bs, length, chunk = 8, 2, 64, 8, 40, 28
    a = make_seq(length, hq, hkv, d, dtype, 0)
    others = [make_seq(length, hq, hkv, d, dtype, 1 + i) for i in range(2)]
    place([a], length, bs, 64, seed=1)
    alone = run_step_(KERNEL, int8_pool(64, bs, hkv, d), [(a, 0, length)])[0][chunk:]
    place([a, *others], length, bs, 64, seed=2)
    pool = int8_pool(64, bs, hkv, d)
    run_step_(KERNEL, pool, [(a, 0, chunk), (others[0], 0, 9)])
    chunked = run_step_(KERNEL, pool, [(others[0], 9, 10), (a, chunk, length), (others[1], 0, 33)])[1]
    place([a, *others], length, bs, 64, seed=3)
    pool = int8_pool(64, bs, hkv, d)
    run_step_(KERNEL, pool, [(a, 0, chunk), (others[0], 0, 20), (others[1], 0, 3)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decoded = torch.cat([run_step_(KERNEL, pool, [(others[0], 20 + i, 21 + i), (a, p, p + 1),
                                                      (others[1], 3 + i, 4 + i)])[1] for i, p in enumerate(range(chunk, length))])
    finally:
        torch.set_num_threads(threads)
    assert alone.float().abs().sum() > 0
    assert torch.equal(chunked, alone) and torch.equal(decoded, alone)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_the_fp8_kernel_matches_the_torch_reference(kv_dtype, dtype):
    """fp8 pools (each value cast on its own, no scale): the C kernel against the torch reference, which reads the
    same fp8 bytes as float32, over decodes, a prefill and an extend with a sliding window and soft-capping."""
    hq, hkv, d, bs = 8, 2, 64, 8
    seqs = [(make_seq(30, hq, hkv, d, dtype, 1), 29, 30), (make_seq(21, hq, hkv, d, dtype, 2), 0, 21),
            (make_seq(45, hq, hkv, d, dtype, 3), 17, 45)]
    place([s for s, _, _ in seqs], 45, bs, 32, seed=4)
    pool = torch.zeros(2, 32, bs, hkv, d, dtype=kv_dtype)
    run = functools.partial(run_step_, window=19, softcap=15.0)
    run(REFERENCE, pool, [(s, 0, a) for s, a, _ in seqs if a > 0])
    ref_pool = pool.clone()
    got, ref = run(KERNEL, pool, seqs), run(REFERENCE, ref_pool, seqs)
    assert torch.equal(pool.view(torch.uint8), ref_pool.view(torch.uint8))
    assert pool.view(torch.uint8).ne(0).any()
    for (_s, a, b), x, y in zip(seqs, got, ref):
        assert x.shape == (b - a, hq, d)
        if dtype == BF:
            assert close_bf16(x, y, ulps=2), (a, b, (x.float() - y.float()).abs().max())
        else:
            assert torch.allclose(x, y, atol=2e-6, rtol=1e-5), (a, b, (x - y).abs().max())


# ---- the 8-bit kernels on every instruction set the library is built for --------------------------------------


def _cpu_flags() -> set[str]:
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return set()
    return set(next((ln for ln in lines if ln.startswith("flags")), "").split())


@functools.cache
def _library_for(march: str):
    """The kernels built for `march` (cpu_kernels.build's target; cached, so test_quant_avx2's x86-64-v3 build is
    this one): "native" is the library itself; x86-64-v3 is an AVX2 + FMA + F16C machine (8-float vectors, fp8
    through fp16), x86-64 one with no SIMD the kernels use (generic vectors, fp8 decoded by moving bits). None where
    it cannot be built or run here."""
    from batchrun.kernels.cpu import attention as cpu_attention

    if march == "native":
        return cpu_attention._library()
    if "x86_64" not in platform.machine():
        return None
    if march == "x86-64-v3" and not {"avx2", "fma", "f16c", "bmi2"} <= _cpu_flags():
        return None
    signatures = {k: cpu_attention.SIGNATURES[k] for k in ("paged_attention_int8", "paged_attention_fp8")}
    return cpu_kernels.build(cpu_kernels.sources(), signatures, march=march)


MARCHES = ["native", "x86-64-v3", "x86-64"]
KV_8BIT = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _attend_8bit(lib, q, pool, tables, row_seq, row_len, window=0, softcap=0.0):
    from batchrun.kernels.cpu import attention as cpu_attention

    rs, rl = torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32)
    if pool.dtype == torch.int8:
        return cpu_attention._paged_attention_8bit(lib.paged_attention_int8, q, pool, tables, rs, rl,
                                                   q.shape[-1] ** -0.5, None, window, softcap)
    return cpu_attention._paged_attention_8bit(lib.paged_attention_fp8, q, pool, tables, rs, rl, q.shape[-1] ** -0.5,
                                               None, window, softcap, int(pool.dtype == torch.float8_e5m2))


def _library_or_skip(march: str):
    if not cpu_kernels.available():
        pytest.skip("needs a C compiler (cc) to build the kernels")
    lib = _library_for(march)
    if lib is None:
        pytest.skip(f"the kernels cannot be built for or run as -march={march} here")
    return lib


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_fp8_bytes_are_read_as_torchs_values(march, kv):
    """Every one of the 256 bytes, as a V row of a context of one key (whose output is its V row exactly): read in
    place by a decode row, and widened into the buffer a tile of several rows reads."""
    lib = _library_or_skip(march)
    fmt = KV_8BIT[kv]
    pool = torch.zeros(2, 2, 4, 4, 64, dtype=torch.uint8)
    pool[1, 1, 0] = torch.arange(256, dtype=torch.uint8).view(4, 64)  # block 1, slot 0: V of key 0
    pool[0] = torch.randint(0, 256, pool[0].shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    pool[0].masked_fill_((pool[0] & 0x7F) >= 0x78, 0)  # finite keys (a NaN or inf key's score is not the point)
    pool = pool.view(fmt)
    tables = torch.tensor([[1]], dtype=torch.int32)
    want = torch.arange(256, dtype=torch.uint8).view(fmt).float().view(4, 64)
    for hq in (4, 8):
        q = torch.randn(2, hq, 64, generator=torch.Generator().manual_seed(hq))
        decode = _attend_8bit(lib, q[:1], pool, tables, [0], [1])
        tile = _attend_8bit(lib, q, pool, tables, [0, 0], [1, 2])
        for got in (decode[0], tile[0]):
            torch.testing.assert_close(got.view(4, hq // 4, 64), want[:, None].expand(4, hq // 4, 64), rtol=0, atol=0,
                                       equal_nan=True)


def _reference_8bit(q, pool, tables, row_seq, row_len):
    """Attention in float64 over the pool's values as torch reads them (int8 dequantized), all rows at once."""
    kv = dequantize(pool).double() if pool.dtype == torch.int8 else pool.float().double()
    hq, d, hkv = q.shape[1], q.shape[2], kv.shape[3]
    k, v = (x[tables[row_seq].long()].flatten(1, 2).repeat_interleave(hq // hkv, dim=2) for x in kv)  # [rows, keys]
    s = torch.einsum("rhd,rnhd->rhn", q.double(), k) * d**-0.5
    s.masked_fill_(torch.arange(s.shape[-1]) >= torch.tensor(row_len)[:, None, None], -torch.inf)
    return torch.einsum("rhn,rnhd->rhd", torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("kv", list(KV_8BIT))
@pytest.mark.parametrize("d,dtype", [(64, torch.float32), (64, BF), (80, torch.float32), (128, BF)],
                         ids=["64-fp32", "64-bf16", "80-fp32", "128-bf16"])
def test_the_8bit_kernels_match_a_float64_reference_at_every_vector_tail(march, kv, d, dtype):
    """Decode rows over contexts that end at and around the vectors' and key chunks' edges (1, 7, 9, 15, 17, 63, 65
    and 130 keys), and a 20-row prefill chunk after 50 cached keys (tiles of 16 and 4 rows, widened into the
    buffer), GQA groups of 4; each decoded row's bits are those the same row gets in the chunk."""
    lib = _library_or_skip(march)
    g = torch.Generator().manual_seed(d)
    hq, hkv, bs, lens = 16, 4, 16, [1, 7, 9, 15, 17, 63, 65, 130]
    nblocks = [(n + bs - 1) // bs for n in [*lens, 70]]
    tables = torch.zeros(len(nblocks), max(nblocks), dtype=torch.int32)
    free = torch.randperm(sum(nblocks) + 1, generator=g).tolist()
    for i, n in enumerate(nblocks):
        tables[i, :n] = torch.tensor([free.pop() for _ in range(n)])
    pool = encode_rows(torch.randn(2, sum(nblocks) + 1, bs, hkv, d, generator=g) * 3, KV_8BIT[kv])
    pool = pool if kv == "int8" else pool.view(KV_8BIT[kv])
    row_seq = list(range(len(lens))) + [len(lens)] * 20
    row_len = lens + list(range(51, 71))
    q = torch.randn(len(row_seq), hq, d, generator=g).to(dtype)
    got = _attend_8bit(lib, q, pool, tables, row_seq, row_len)
    ref = _reference_8bit(q, pool, tables, row_seq, row_len)
    if dtype == BF:
        assert close_bf16(got, ref, ulps=1.5), (got.float() - ref).abs().max()
    else:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for i in (len(lens), len(lens) + 15, len(lens) + 16, len(row_seq) - 1):  # each tile's first and last row
        alone = _attend_8bit(lib, q[i : i + 1], pool, tables, [row_seq[i]], [row_len[i]])
        assert torch.equal(alone[0], got[i]), i


# ---- the engine -------------------------------------------------------------------------------------------------


def test_a_bad_kv_cache_dtype_is_refused_before_anything_loads():
    with pytest.raises(EngineArgsError, match="kv_cache_dtype: must be one of auto, int8, fp8_e4m3, fp8_e5m2"):
        EngineArgs("builtin:none", kv_cache_dtype="int4")
    # fp8 runs on the Triton kernels too (here interpreted: TRITON_INTERPRET=1 without CUDA, tests/conftest.py)
    EngineArgs("builtin:none", kv_cache_dtype="fp8_e4m3", attention_backend="triton").check_environment()


def test_the_same_memory_holds_more_tokens_and_swaps_keep_values_and_scales(make_ckpt):
    path = make_ckpt("llama")
    plain = LLM(str(path), device="cpu", kv_cache_memory="4MiB", swap_space="1MiB")
    fp8 = LLM(str(path), device="cpu", kv_cache_memory="4MiB", swap_space="1MiB", kv_cache_dtype="fp8_e4m3")
    small = LLM(str(path), device="cpu", kv_cache_memory="4MiB", swap_space="1MiB", kv_cache_dtype="int8")
    runner = small.engine.runner
    head_dim = runner.shape.head_dim
    assert runner.kv_cache.dtype == torch.int8 and runner.kv_cache.shape[-1] == head_dim + 4
    ratio = 4 * head_dim / (head_dim + 4)  # fp32 bytes per value / int8 bytes per value and scale
    assert small.engine.config.num_blocks == int(plain.engine.config.num_blocks * ratio)
    assert runner.host_cache.dtype == torch.int8
    assert fp8.engine.config.num_blocks == 4 * plain.engine.config.num_blocks
    assert fp8.engine.runner.kv_cache.dtype == fp8.engine.runner.host_cache.dtype == torch.float8_e4m3fn

    # a block's bytes (values and scales) out to host memory, into another block, and copied (copy-on-write)
    g = torch.Generator().manual_seed(0)
    runner.kv_cache[:, :, 3] = torch.randint(-127, 128, runner.kv_cache[:, :, 3].shape, generator=g, dtype=torch.int8)
    runner.kv_cache[:, :, 3, ..., -4:] = torch.rand(runner.kv_cache[:, :, 3, ..., 0].shape, generator=g)[..., None] \
        .contiguous().view(torch.int8)
    saved = runner.kv_cache[:, :, 3].clone()
    runner.swap_out([(3, 1)])
    runner.kv_cache[:, :, 3] = 0
    runner.swap_in([(1, 7)])
    assert torch.equal(runner.kv_cache[:, :, 7], saved)
    runner.copy_blocks([(7, 9)])
    assert torch.equal(runner.kv_cache[:, :, 9], saved)
    assert scales(runner.kv_cache[:, :, 9]).gt(0).all()


@pytest.fixture(scope="module")
def references_8bit(make_ckpt):
    """The batch-invariance targets run alone on an 8-bit pool (fp32), per kv_cache_dtype; on the CPU, where there
    is a GPU too (fp8 pools are the CPU's, and batch invariance is promised there, not for cuBLAS's linears)."""
    path = make_ckpt("llama")
    refs = {}
    for kv in ("int8", "fp8_e4m3"):
        llm = LLM(str(path), dtype="float32", device="cpu", batch_invariant=True, max_num_seqs=1,
                  enable_prefix_caching=False, num_kv_blocks=64, kv_cache_dtype=kv)
        prompts = _prompts(llm.config.vocab_size)
        refs[kv] = (prompts, [_generate(llm, [p], [sp])[0] for p, sp in zip(prompts, TARGET_PARAMS)])
    return path, refs


@needs_kernels
@pytest.mark.parametrize(("kv", "settings", "seed"), [
    ("int8", dict(max_num_seqs=12, num_kv_blocks=14, swap_space=2**20, preemption_mode="swap",
                  enable_prefix_caching=False), 6),
    ("int8", dict(max_num_seqs=7, max_num_batched_tokens=40, num_kv_blocks=64), 5),
    ("fp8_e4m3", dict(max_num_seqs=12, num_kv_blocks=14, swap_space=2**20, preemption_mode="swap",
                      enable_prefix_caching=False), 6),
], ids=["int8-swap", "int8-chunked-prefix-cache", "fp8-swap"])
def test_int8_tokens_do_not_depend_on_the_batch(references_8bit, kv, settings, seed):
    """tests/test_batch_invariance.py's property with an 8-bit pool: quantization is per token (int8) or per value
    (fp8), so a token's stored bytes, and every row's attention over them, are the same in any batch (the targets'
    log-probs compared bit for bit). The swap cases preempt a target to host memory and back (fp8's block moves
    copy bytes)."""
    path, refs = references_8bit
    targets, expected = refs[kv]
    llm = LLM(str(path), dtype="float32", device="cpu", batch_invariant=True, kv_cache_dtype=kv, **settings)
    rng = random.Random(seed)
    preempting = "swap_space" in settings
    others, other_params = _others(rng, targets, llm.config.vocab_size, preempting)
    order = [*range(len(targets), len(targets) + len(others)), *range(len(targets))]
    if not preempting:
        rng.shuffle(order)
    prompts, params = targets + others, TARGET_PARAMS + other_params
    got = dict(zip(order, _generate(llm, [prompts[i] for i in order], [params[i] for i in order])))
    assert [got[i] for i in range(len(targets))] == expected
    if preempting:
        assert llm.metrics()["num_preemptions_swap"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_greedy_tokens_agree_with_the_unquantized_engine(make_ckpt, dtype):
    """A tiny random model, 16 prompts x 24 greedy tokens: enough rows and tokens the same on the int8 pool as on
    the unquantized one. A row differs from its first differing token on, so the bound is on rows."""
    path = make_ckpt("llama")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randrange(3, 40))]} for _ in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(path), device="cpu", dtype=dtype, kv_cache_memory="8MiB", kv_cache_dtype=kv)
        runs[kv] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    same_rows = sum(a == b for a, b in zip(runs["auto"], runs["int8"]))
    same_tokens = sum(x == y for a, b in zip(runs["auto"], runs["int8"]) for x, y in zip(a, b))
    print(f"{dtype}: int8 KV greedy rows equal {same_rows}/16, tokens {same_tokens}/384")
    rows, tokens = {"float32": (12, 0.88), "bfloat16": (8, 0.8)}[dtype]
    assert same_rows >= rows and same_tokens >= tokens * 384, (same_rows, same_tokens)


@pytest.mark.parametrize("kind", POOLS)
def test_greedy_tokens_on_the_triton_kernels_are_the_c_kernels_on_an_8bit_pool(make_ckpt, kind):
    """The same tiny fp32 model on the same 8-bit pool format through the Triton backend (compiled on a GPU,
    interpreted without one: so 3 prompts x 8 tokens) and through the CPU's: the same greedy tokens. The stores
    write the same bytes (test_the_triton_store_writes_the_torch_stores_bytes), so only the attention's
    summation order differs."""
    from test_kernels import DEVICE

    path = make_ckpt("llama")
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]} for n in (5, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kv = {"int8": "int8", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}[kind]
    runs = []
    for device, backend in ((DEVICE.type, "triton"), ("cpu", "auto")):
        llm = LLM(str(path), device=device, dtype="float32", attention_backend=backend, num_kv_blocks=32,
                  kv_cache_dtype=kv, num_speculative_tokens=0)
        assert llm.engine.runner.backend.name == ("triton" if backend == "triton" else "torch")
        runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


@pytest.mark.slow
@needs_kernels
def test_int8_top1_agreement_with_the_unquantized_model(smollm2):
    """SmolLM2-135M-Instruct's own greedy replies (fp32, unquantized: the smollm2 fixture) to 8 chat questions, 32
    tokens each, fed back teacher-forced through the same weights on an int8 KV pool (a runner of its own), one
    decode step per token: the int8 argmax at every position against the unquantized one's, which is the reply's
    next token (docs/kv-cache.md has the figures)."""
    from test_real_model import QUESTIONS, chat_text

    tok = smollm2.tokenizer
    prompts = [tok(chat_text(tok, q), add_special_tokens=False).input_ids for q in QUESTIONS]
    new_tokens, bs = 32, 16
    outs = smollm2.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    replies = [list(o.outputs[0].token_ids) for o in outs]
    plain = smollm2.engine.runner
    shape = cache_shape(plain.model, bs, torch.float32, torch.int8)
    blocks = max(-(-(len(p) + new_tokens) // bs) for p in prompts)
    runner = ModelRunner(plain.model, shape, blocks * len(prompts), 0, torch.device("cpu"), batch_invariant=True)
    assert runner.kv_cache.dtype == torch.int8 and runner.backend.cpu_kernels
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    logits = runner.compute_logits(SchedulerOutput(
        seqs=[ScheduledSeq(i, p, 0, tables[i], True) for i, p in enumerate(prompts)], num_decodes=0))
    top1 = [[t] for t in logits.argmax(-1).tolist()]
    for step in range(1, new_tokens):
        seqs = [ScheduledSeq(i, [r[step - 1]], len(p) + step - 1, tables[i], True)
                for i, (p, r) in enumerate(zip(prompts, replies))]
        for row, t in zip(top1, runner.compute_logits(SchedulerOutput(seqs=seqs, num_decodes=len(seqs)))
                          .argmax(-1).tolist()):
            row.append(t)
    positions = len(prompts) * new_tokens
    agree = sum(a == b for g, r in zip(top1, replies) for a, b in zip(g, r))
    print(f"int8 KV teacher-forced top-1 agreement with the unquantized model: {agree}/{positions}")
    assert agree / positions >= 0.98, f"{agree}/{positions}"


# ---- the Triton kernels, interpreted (TRITON_INTERPRET=1 without CUDA: tests/conftest.py) -------------------------
# Each over the three 8-bit pools: int8 rows with their scale, and fp8 (e4m3fn, e5m2) values with none.



def as_pool(kv: torch.Tensor, kind: str) -> torch.Tensor:
    """Float K/V [..., D] as a pool of `kind` holds them."""
    return quantize_rows(kv) if kind == "int8" else to_fp8(kv, POOLS[kind])


def _8bit_pool(kind: str, block_size: int, hkv: int, d: int, dtype: torch.dtype, seq_lens: list[int]):
    from test_kernels import Pool

    pool = Pool(block_size, hkv, d, dtype, seq_lens)
    pool.kv_cache = as_pool(pool.kv_cache, kind)  # random K/V as the pool holds them
    return pool


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_the_triton_store_writes_the_torch_stores_bytes(dtype, kind):
    """The same bytes as the torch store, which the C kernels read too: fp8 values over the whole range (the
    interpreter's own fp32 -> e5m2 cast rounds otherwise: the kernel rounds in integer ops), values past the
    format's largest clamped, ties between two fp8 neighbours to even."""
    from test_kernels import DEVICE

    from batchrun.kernels.triton import store_kv
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(11, 3, 48, generator=g) for _ in range(2))
    if kind != "int8":
        values = torch.arange(256, dtype=torch.uint8).view(POOLS[kind]).float()
        finite = values[values.isfinite()].unique()
        between = (finite[1:] + finite[:-1]) / 2  # exact ties
        picks = torch.cat([finite, between, torch.tensor([1e6, -1e6, 30.98])])
        k = k * picks[torch.randint(len(picks), k.shape, generator=g)]
        v = picks[torch.randint(len(picks), v.shape, generator=g)]
    k, v = k.to(dtype=dtype, device=DEVICE), v.to(dtype=dtype, device=DEVICE)
    slots = torch.tensor([3, 17, -1, 0, 8, 9, 30, 31, 12, 5, 6], device=DEVICE)
    shape = (2, 4, 8, 3, 48 + 4 if kind == "int8" else 48)
    ours, ref = torch.zeros(shape, dtype=POOLS[kind], device=DEVICE), torch.zeros(shape, dtype=POOLS[kind], device=DEVICE)
    store_kv(k, v, ours, slots)
    store_kv_torch(k, v, ref, slots, has_padding=True)
    assert torch.equal(as_bytes(ours), as_bytes(ref))
    assert as_bytes(ours).ne(0).any()


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize(("block_size", "d", "group", "dtype", "window", "softcap", "partition"), [
    (8, 64, 4, torch.float32, 0, 0.0, 32), (16, 48, 1, BF, 0, 0.0, None), (8, 64, 2, torch.float32, 21, 10.0, None),
], ids=["gqa4-split", "bf16-d48", "window-softcap"])
def test_triton_8bit_attention_matches_its_reference(block_size, d, group, dtype, window, softcap, partition, kind):
    """Decode (split into partitions and not) and prefill / extend rows (several blocks, partial last blocks) on an
    int8 or fp8 pool against the fp64 references, which read the pool's values as float32."""
    from test_kernels import DEVICE, TOL

    from batchrun.kernels.triton import paged_decode_attention, paged_prefill_attention
    from batchrun.kernels.triton.decode_attention import paged_decode_attention_ref
    from batchrun.kernels.triton.prefill_attention import paged_prefill_attention_ref

    hkv, seq_lens = 2, [1, 13, 40, 70]
    pool = _8bit_pool(kind, block_size, hkv, d, dtype, seq_lens)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(seq_lens), hkv * group, d, generator=g).to(dtype=dtype, device=DEVICE)
    got = paged_decode_attention(q, pool.kv_cache, pool.block_tables, pool.seq_lens, d**-0.5, max(seq_lens),
                                 partition_size=partition, block_n=16, window=window, softcap=softcap)
    ref = paged_decode_attention_ref(q, pool.kv_cache, pool.block_tables, pool.seq_lens, d**-0.5, window, softcap)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    query_lens = [1, 13, 25, 9]  # a prefill of the whole 13, extends after 15 and 61 cached tokens
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(sum(query_lens), hkv * group, d, generator=g).to(dtype=dtype, device=DEVICE)
    got = paged_prefill_attention(qp, pool.kv_cache, pool.block_tables, pool.seq_lens, starts, max(query_lens),
                                  d**-0.5, block_m=16, block_n=16, window=window, softcap=softcap)
    ref = paged_prefill_attention_ref(qp, pool.kv_cache, pool.block_tables, pool.seq_lens, starts, d**-0.5, window,
                                      softcap)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_the_triton_backend_on_an_8bit_pool_matches_the_torch_backend(dtype, kind):
    """A mixed step (decodes, a prefill, an extend, a padding token) through TritonBackend and the torch reference
    on the same int8 or fp8 pool: the same bytes stored, the outputs within the dtype's tolerance; then a
    copy-on-write block copy (the Triton kernel) moves values (and int8's scales) whole."""
    from test_kernels import PARTITION, TILE, TOL, mixed_step

    from batchrun.model.layers.triton_backend import TritonBackend
    from batchrun.model.layers.triton_backend import copy_blocks as triton_copy_blocks

    q, k, v, cache, meta = mixed_step(16, 2, 4, 64, dtype)
    cache = as_pool(cache, kind)
    torch_cache = cache.clone()
    backend = TritonBackend(partition_size=PARTITION, decode_block_n=TILE, prefill_block_m=TILE, prefill_block_n=TILE)
    out = backend.forward(q, k, v, cache, meta, 64**-0.5)
    expected = REFERENCE.forward(q, k, v, torch_cache, meta, 64**-0.5)
    real = meta.slot_mapping.shape[0] - 1  # the padding token's output is unspecified
    torch.testing.assert_close(out[:real], expected[:real], **TOL[dtype])
    assert torch.equal(as_bytes(cache), as_bytes(torch_cache))
    full = cache.unsqueeze(0).contiguous()  # [layers, 2, blocks, ...]
    saved = as_bytes(full[:, :, 1]).clone()
    triton_copy_blocks(full, [(1, 4)])
    assert torch.equal(as_bytes(full[:, :, 4]), saved)
    assert scales(full[:, :, 4]).gt(0).any() if kind == "int8" else saved.ne(0).any()
