"""The C attention kernel alone: `python -m benchmarks.micro.kernels [--baseline REF] [--threads N]`.

Prints ms per call and GFLOP/s (4 * heads * head_dim flops per query-key pair: q.K and p.V) for
  - decode steps: S sequences, one query each, over a context of C keys (fp32 and bf16);
  - prefill steps: P prompts of L tokens, causal, against what the torch path does instead (one
    `F.scaled_dot_product_attention` per prompt on its new K/V).
With --baseline REF the attention kernel of the C sources as of git REF (e.g. `main`: its `paged_attention`,
or the older `paged_decode` for decode cases) is built and timed beside the current one, in the same process
and interleaved, so that a busy machine slows both alike.
Each figure is the best of --repeats rounds (the median with --median); with --threads 1 the clock is this thread's
CPU time (what a busy machine's other processes take is not counted), else the wall clock. The shapes default to
SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64). The kernel runs as a bf16 engine's default does: on a CPU
with AMX, prefill tiles on AMX and decode rows on the vector kernel (cpu_kernels.attention.AMX_PREFILL_LANES).
--kv-cache-dtypes auto,int8,fp8_e4m3,fp8_e5m2 times the pools of those `engine.kv_cache_dtype`s (the same random K/V
stored in each format) on each case, every format's kernel (and the baseline's) interleaved round by round.
REF may predate the kernels' move to batchrun/kernels/cpu/csrc/ (batchrun/model/csrc/ then) or their split by
family (one cpu_kernels.c then): every C source and header of its csrc/ is built, whichever layout it has.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import attention as cpu_attention
from batchrun.kernels.cpu.attention import AMX_PREFILL_LANES
from batchrun.kernels.layouts.kv_rows import FP8, KV_CACHE_DTYPES, encode_rows
from benchmarks.harness.cli_args import parser

_P, _I, _F, _B = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# paged_decode reports a failed allocation
_OLD_DECODE = {"paged_decode": (ctypes.c_int, [_P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, _B])}
# Where the C sources have lived, newest first: a --baseline revision has one of them.
CSRC_DIRS = ("batchrun/kernels/cpu/csrc", "batchrun/model/csrc")
_REPO = Path(__file__).resolve().parents[2]


CLOCK = time.perf_counter  # main() switches to this thread's CPU time when it runs on one thread


def _seconds(fn: Callable[[], object], budget_s: float = 0.05) -> float:
    """Seconds per call of fn, averaged over enough calls to fill about budget_s."""
    fn()
    t, calls = CLOCK(), 0
    while (elapsed := CLOCK() - t) < budget_s or calls < 3:
        fn()
        calls += 1
    return elapsed / calls


def revision_source(ref: str, repo: Path = _REPO) -> dict[str, bytes]:
    """The C sources and headers of git revision `ref` of `repo` (the first of CSRC_DIRS it has; {} where it has
    none), by file name, for cpu_kernels.build (what --baseline builds, here and in benchmarks.micro.linears): one
    cpu_kernels.c before the kernels were split by family, a .c file per family and common.h after."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, check=True).stdout

    for csrc in CSRC_DIRS:
        paths = git("ls-tree", "--name-only", ref, f"{csrc}/").decode().split()
        if paths:
            return {Path(p).name: git("show", f"{ref}:{p}") for p in paths if p.endswith((".c", ".h"))}
    return {}


def mentions(src: dict[str, bytes], text: str) -> bool:
    """Whether one of the sources contains `text` (e.g. "int paged_attention(": the kernel is defined there)."""
    return any(text.encode() in source for source in src.values())


def _baseline(ref: str) -> ctypes.CDLL | None:
    src = revision_source(ref)
    if mentions(src, "int paged_attention("):  # (an older revision's has no amx_lanes, or no window and
        restype, args = cpu_attention.SIGNATURES["paged_attention"]  # softcap either)
        args = args if mentions(src, "softcap") else args[:-2]
        args = args if mentions(src, "amx_lanes") else args[:-1]
        signatures = {"paged_attention": (restype, args)}
        for name in ("paged_attention_int8", "paged_attention_fp8"):  # the 8-bit pools' kernels, where REF has them
            if mentions(src, f"int {name}("):
                restype, args = cpu_attention.SIGNATURES[name]
                if name == "paged_attention_fp8" and mentions(src, "const float *lut"):  # its table (_fp8)
                    args = [*args[:-1], ctypes.c_void_p]
                signatures[name] = (restype, args)
        return cpu_kernels.build(src, signatures)
    if not mentions(src, "int paged_decode("):
        print(f"{ref}: its C sources have neither paged_attention nor paged_decode; no baseline")
        return None
    return cpu_kernels.build(src, _OLD_DECODE)


def _old_attention(old: ctypes.CDLL, q, kv, tables, rows, lens, scale, out) -> None:
    """The baseline's paged_attention, called as cpu_attention.paged_attention calls the current one."""
    n, hq, d = q.shape
    k_ptr = kv.data_ptr()
    old.paged_attention(q.data_ptr(), q.stride(0), k_ptr, k_ptr + kv.stride(0) * kv.element_size(), tables.data_ptr(),
                        tables.stride(0), rows.data_ptr(), lens.data_ptr(), out.data_ptr(), n, hq, kv.shape[3], d,
                        kv.shape[2], scale, int(q.dtype == torch.bfloat16),
                        *[AMX_PREFILL_LANES, 0, 0.0][: len(old.paged_attention.argtypes) - 16])  # what it takes


def _pool(num_seqs: int, ctx: int, hkv: int, d: int, bs: int, dtype: torch.dtype, g: torch.Generator):
    width = (ctx + bs - 1) // bs
    kv = torch.randn(2, num_seqs * width + 1, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(num_seqs * width + 1, generator=g)[: num_seqs * width].view(num_seqs, width)
    return kv, tables.to(torch.int32).contiguous()


def _encoded(kv: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """The float pool kv as a pool of `kv_cache_dtype` holds it (auto: kv itself)."""
    pool_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if pool_dtype is None:
        return kv
    encoded = encode_rows(kv, pool_dtype)
    return encoded.view(pool_dtype) if pool_dtype in FP8 else encoded


@cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def _fp8(old: ctypes.CDLL, pool: torch.Tensor) -> int:
    """The baseline fp8 kernel's last argument: the format's 256 values (before its bit decoding), or e5m2 or not."""
    if old.paged_attention_fp8.argtypes[-1] is ctypes.c_void_p:
        return _fp8_table(pool.dtype).data_ptr()
    return int(pool.dtype == torch.float8_e5m2)


def _calls(old: ctypes.CDLL | None, pool: torch.Tensor, q, tables, rows, lens, scale, out) -> dict[str, Callable]:
    """The new kernel for the pool's format, and the baseline's where it has one ("new", "old")."""
    if pool.dtype == torch.int8:
        calls = {"new": lambda: cpu_attention.paged_attention_int8(q, pool, tables, rows, lens, scale, out=out)}
        name = "paged_attention_int8"
    elif pool.dtype in FP8:
        calls = {"new": lambda: cpu_attention.paged_attention_fp8(q, pool, tables, rows, lens, scale, out=out)}
        name = "paged_attention_fp8"
    else:
        calls = {"new": lambda: cpu_attention.paged_attention(q, pool, tables, rows, lens, scale, out=out,
                                                              amx_lanes=AMX_PREFILL_LANES)}
        if old is not None and hasattr(old, "paged_attention"):
            calls["old"] = lambda: _old_attention(old, q, pool, tables, rows, lens, scale, out)
        return calls
    if old is not None and hasattr(old, name):
        kernel = getattr(old, name)
        extra = [_fp8(old, pool)] if pool.dtype in FP8 else []
        k_ptr = pool.data_ptr()
        calls["old"] = lambda: kernel(q.data_ptr(), q.stride(0), k_ptr, k_ptr + pool.stride(0), tables.data_ptr(),
                                      tables.stride(0), rows.data_ptr(), lens.data_ptr(), out.data_ptr(), q.shape[0],
                                      q.shape[1], pool.shape[3], q.shape[2], pool.shape[2], scale,
                                      int(q.dtype == torch.bfloat16), 0, 0.0, *extra)
    return calls


def _rounds(calls: dict[tuple[str, str], Callable], args) -> dict[tuple[str, str], float]:
    """Seconds per call of each, every one timed once a round, interleaved: the best round's (the median with
    --median)."""
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(args.repeats):
        for key, fn in calls.items():
            times[key].append(_seconds(fn))
    return {key: statistics.median(t) if args.median else min(t) for key, t in times.items()}


def decode_case(num_seqs: int, ctx: int, dtype: torch.dtype, args, old: ctypes.CDLL | None) -> list[str]:
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    kv, tables = _pool(num_seqs, ctx, hkv, d, bs, dtype, g)
    q = torch.randn(num_seqs, hq, d, generator=g).to(dtype)
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
    rows = torch.arange(num_seqs, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = d**-0.5
    calls = {}
    for name in args.kv_cache_dtypes:
        for who, fn in _calls(old, _encoded(kv, name), q, tables, rows, lens, scale, out).items():
            calls[(name, who)] = fn
    if old is not None and not hasattr(old, "paged_attention") and "auto" in args.kv_cache_dtypes:
        k_ptr = kv.data_ptr()
        v_ptr = k_ptr + kv.stride(0) * kv.element_size()
        calls[("auto", "old")] = lambda: old.paged_decode(q.data_ptr(), q.stride(0), k_ptr, v_ptr, tables.data_ptr(),
                                                          tables.stride(0), lens.data_ptr(), out.data_ptr(), ctx,
                                                          num_seqs, hq, hkv, d, bs, scale, int(dtype == torch.bfloat16))
    t = _rounds(calls, args)
    flops = 4 * num_seqs * hq * ctx * d
    lines = []
    for name in args.kv_cache_dtypes:
        new = t[(name, "new")]
        line = (f"decode  {str(dtype)[6:]:8s} kv {name:8s} seqs {num_seqs:4d} ctx {ctx:5d}: new {1e3 * new:7.3f} ms "
                f"{flops / new / 1e9:6.1f} GFLOP/s")
        if (name, "old") in t:
            base = t[(name, "old")]
            line += f" | old {1e3 * base:7.3f} ms {flops / base / 1e9:6.1f} GFLOP/s | speed-up {base / new:.2f}x"
        if name != "auto" and ("auto", "new") in t:
            line += f" | time / auto's {new / t[('auto', 'new')]:.2f}"
        lines.append(line)
    return lines


def prefill_case(num_prompts: int, length: int, dtype: torch.dtype, args, old: ctypes.CDLL | None) -> list[str]:
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    kv, tables = _pool(num_prompts, length, hkv, d, bs, dtype, g)
    n = num_prompts * length
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    # the prompts' own K/V, as the torch path reads them (the kernel reads the same values from the pool)
    width = tables.shape[1]
    k = kv[0][tables.long()].view(num_prompts, width * bs, hkv, d)[:, :length].reshape(n, hkv, d)
    v = kv[1][tables.long()].view(num_prompts, width * bs, hkv, d)[:, :length].reshape(n, hkv, d)
    rows = torch.arange(num_prompts, dtype=torch.int32).repeat_interleave(length)
    lens = torch.arange(1, length + 1, dtype=torch.int32).repeat(num_prompts)
    out = torch.empty_like(q)
    scale = d**-0.5

    def sdpa():
        for i in range(num_prompts):
            s, e = i * length, (i + 1) * length
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).unsqueeze(0), k[s:e].transpose(0, 1).unsqueeze(0),
                                               v[s:e].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)

    calls = {("sdpa", "new"): sdpa}
    for name in args.kv_cache_dtypes:
        for who, fn in _calls(old, _encoded(kv, name), q, tables, rows, lens, scale, out).items():
            calls[(name, who)] = fn
    t = _rounds(calls, args)
    flops = 4 * hq * d * num_prompts * length * (length + 1) // 2
    sd = t[("sdpa", "new")]
    lines = []
    for name in args.kv_cache_dtypes:
        new = t[(name, "new")]
        line = (f"prefill {str(dtype)[6:]:8s} kv {name:8s} {num_prompts:3d} x {length:5d} tokens: kernel "
                f"{1e3 * new:8.3f} ms {flops / new / 1e9:6.1f} GFLOP/s | SDPA per prompt {1e3 * sd:8.3f} ms "
                f"{flops / sd / 1e9:6.1f} GFLOP/s | kernel/SDPA time {new / sd:.2f}")
        if (name, "old") in t:
            line += f" | old {1e3 * t[(name, 'old')]:8.3f} ms, speed-up {t[(name, 'old')] / new:.2f}x"
        if name != "auto" and ("auto", "new") in t:
            line += f" | time / auto's {new / t[('auto', 'new')]:.2f}"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, threads=2, repeats=5, block_size=16)
    ap.add_argument("--baseline", metavar="REF", help="also time the attention kernel of git REF (e.g. main)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--decode", default="64x150,64x500,16x150,16x2000", help="SEQSxCTX,... decode cases")
    ap.add_argument("--prefill", default="4x128,2x512,1x2048", help="PROMPTSxLEN,... prefill cases ('' for none)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--kv-cache-dtypes", default="auto", type=lambda text: text.split(","),
                    help="the pools' formats, comma-separated: auto, int8, fp8_e4m3, fp8_e5m2 (default auto)")
    ap.add_argument("--median", action="store_true", help="the median round, not the best")
    args = ap.parse_args(argv)
    if unknown := set(args.kv_cache_dtypes) - set(KV_CACHE_DTYPES):
        ap.error(f"--kv-cache-dtypes: unknown {', '.join(sorted(unknown))}")
    if not cpu_kernels.available():
        print("the C kernels are not available (no compiler, or BATCHRUN_CPU_KERNELS=0)")
        return 1
    torch.set_num_threads(args.threads)
    global CLOCK
    if args.threads == 1:  # everything runs on this thread: its CPU time ignores other processes' turns
        CLOCK = time.thread_time
    old = _baseline(args.baseline) if args.baseline else None
    print(f"threads {args.threads}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, "
          f"block {args.block_size}, {'median' if args.median else 'best'} of {args.repeats}")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    for dtype in dtypes:
        for case in filter(None, args.decode.split(",")):
            seqs, ctx = map(int, case.split("x"))
            print("\n".join(decode_case(seqs, ctx, dtype, args, old)), flush=True)
    for dtype in dtypes:
        for case in filter(None, args.prefill.split(",")):
            prompts, length = map(int, case.split("x"))
            print("\n".join(prefill_case(prompts, length, dtype, args, old)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
