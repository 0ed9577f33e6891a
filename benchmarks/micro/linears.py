"""The CPU linears alone: `python -m benchmarks.micro.linears [--baseline REF] [--rows 1,8,16,64] [--dtypes ...]`.

Times one pass over a model's linears as a decode or prefill step makes it: --layers distinct copies of each
layer shape (so that the weights stream from memory, as in a step, instead of sitting in cache) and the
lm_head, at each row count, through
  - batchrun's panel kernels (cpu_kernels.linears: linear_f32 for fp32, linear_bf16 for bf16);
  - oneDNN on its reordered weights (OneDNNLinear's matmul), what they stand in for; for bf16 on a CPU where
    oneDNN has no bf16 kernels (no AVX512-BF16 or AMX), torch's F.linear instead;
  - with --baseline REF, the same kernels as built from git REF's C sources (when REF has them).
The systems run in turn within each of --repeats rounds, and each figure is the median of its rounds: a
machine's speed drifts over minutes, and the ratios are what to read. The shapes default to SmolLM2-135M's (hidden
576, MLP 1536, 9/3 heads of 64, vocab 49152, 30 layers); docs/cpu-kernels.md quotes a run of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import OneDNNLinear
from benchmarks.harness.cli_args import parser
from benchmarks.micro.kernels import mentions, revision_source

# linear_bf16 was linear_bf16_small before it served every row count
_LINEARS = ("pack_f32_linear", "linear_f32", "pack_bf16_linear", "linear_bf16", "linear_bf16_small", "f32_linear_panel")


def _baseline(ref: str):
    """The panel kernels of git REF's C sources, or None where REF lacks them."""
    src = revision_source(ref)
    if not mentions(src, "void linear_f32("):
        print(f"{ref}: its C sources have no linear_f32; no baseline")
        return None
    signatures = {**cpu_linears.SIGNATURES, "linear_bf16_small": cpu_linears.SIGNATURES["linear_bf16"]}
    return cpu_kernels.build(src, {n: signatures[n] for n in _LINEARS if mentions(src, n + "(")})


def _packed(lib, weight: torch.Tensor) -> torch.Tensor:
    """weight packed by lib's own packing function, in a buffer large enough for any revision's layout."""
    n, k = weight.shape
    buf = torch.empty((n + 47) // 48 * 48 * (k + 1) + 16 * (k + 1), dtype=weight.dtype)
    pack = lib.pack_f32_linear if weight.dtype == torch.float32 else lib.pack_bf16_linear
    pack(weight.data_ptr(), n, k, buf.data_ptr())
    return buf


def _shapes(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
    """(out, in) of a decoder layer's fused linears: qkv, o, gate|up, down."""
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
            (hidden, inter)]


def _kernel_pass(lib, packs: list[torch.Tensor], weights: list[torch.Tensor], xs: dict[int, torch.Tensor],
                 y: torch.Tensor, bf: bool) -> None:
    """One pass over the weights through lib's panel kernel, as a step makes it."""
    rows = y.shape[0]
    for w, p in zip(weights, packs):
        n, k = w.shape
        if bf:
            linear_bf16 = getattr(lib, "linear_bf16", None) or lib.linear_bf16_small
            linear_bf16(xs[k].data_ptr(), rows, p.data_ptr(), n, k, None, y.data_ptr())
        else:
            lib.linear_f32(xs[k].data_ptr(), k, rows, p.data_ptr(), n, k, None, y.data_ptr())


def medians_in_turn(systems: list[str], one_pass: Callable[[str], None], repeats: int) -> dict[str, float]:
    """Each system's median seconds for one_pass(system), the systems in turn in each of `repeats` rounds (the order
    alternating between rounds)."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(repeats):
        for name in systems[:: 1 if r % 2 == 0 else -1]:
            t = time.perf_counter()
            one_pass(name)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_dtype(dtype: torch.dtype, args, old) -> list[str]:
    g = torch.Generator().manual_seed(0)
    # layer by layer, as a forward calls them (grouping the calls by shape flatters oneDNN at few rows)
    shapes = [s for _ in range(args.layers)
              for s in _shapes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim)]
    shapes.append((args.vocab, args.hidden))
    weights = [(torch.randn(n, k, generator=g) * k**-0.5).to(dtype) for n, k in shapes]
    onednn_dtype = dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    reference = "oneDNN" if onednn_dtype else "F.linear"
    if onednn_dtype:
        matmuls = [OneDNNLinear(nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype))._matmul for w in weights]
    else:
        matmuls = [lambda x, w=w: F.linear(x, w) for w in weights]
    libs = {"batchrun": cpu_linears._library(), **({"baseline": old} if old is not None else {})}
    packs = {name: [_packed(lib, w) for w in weights] for name, lib in libs.items()}
    bf = dtype == torch.bfloat16
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    lines = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {w.shape[1] for w in weights}}
        y = torch.empty(rows, max(w.shape[0] for w in weights), dtype=dtype)
        def one_pass(name: str, xs: dict = xs, y: torch.Tensor = y) -> None:
            if name == reference:
                for w, matmul in zip(weights, matmuls):
                    matmul(xs[w.shape[1]])
            else:
                _kernel_pass(libs[name], packs[name], weights, xs, y, bf)

        med = medians_in_turn([*libs, reference], one_pass, args.repeats)
        line = (f"{str(dtype)[6:]:8s} rows {rows:5d}: batchrun {1e3 * med['batchrun']:8.2f} ms "
                f"({weight_bytes / med['batchrun'] / 1e9:5.1f} GB/s of weights) | {reference} "
                f"{1e3 * med[reference]:8.2f} ms | batchrun/{reference} time {med['batchrun'] / med[reference]:.2f}")
        if "baseline" in med:
            line += f" | baseline {1e3 * med['baseline']:8.2f} ms, batchrun/baseline {med['batchrun'] / med['baseline']:.2f}"
        lines.append(line)
        print(line, flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, threads=2, repeats=5)
    ap.add_argument("--baseline", metavar="REF", help="also time the panel kernels of git REF (e.g. main)")
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 16, 24, 32, 128],
                    help="row counts, comma-separated (default 1,8,16,24,32,128)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args(argv)
    if not cpu_linears.has_panel_linears():
        print("batchrun's panel kernels are not available here (no compiler, or a CPU without AVX-512 or AVX2)")
        return 1
    torch.set_num_threads(args.threads)
    old = _baseline(args.baseline) if args.baseline else None
    print(f"threads {args.threads}, {args.layers} layers of hidden {args.hidden} / MLP {args.intermediate} and a "
          f"{args.vocab}-row lm_head, median of {args.repeats} rounds")
    with torch.no_grad():
        for name in args.dtypes.split(","):
            run_dtype(getattr(torch, name), args, old)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
