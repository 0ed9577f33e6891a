"""Variants of the linear kernels' tuning constants, timed in turn: `python -m benchmarks.micro.linear_variants
--shape 1b --rows 80,96 --variant AMX_PACK_TILES=4 --variant AMX_KB=8,AMX_PACK_TILES=4 [--baseline REF]`.

Each --variant rebuilds csrc/linears.c with some of its `#define NAME VALUE` lines changed and times a pass over
the shape's linears (weights streamed, as in benchmarks.micro.linears) beside the current sources, oneDNN and,
with --baseline, git REF's kernels, in turn within each round (the order alternating); each figure is a median of --repeats rounds and its
ratio to oneDNN's. Shapes: smollm2 (30 layers), 1b (Llama-3.2-1B, 4 layers), 8b (Llama-3.1-8B, 2 layers), each
with its lm_head. The bf16 kernels only; docs/cpu-kernels.md ("Measurements") quotes its runs.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import linears as cpu_linears
from batchrun.model.layers.linear import OneDNNLinear
from benchmarks.harness.cli_args import parser
from benchmarks.micro.kernels import revision_source
from benchmarks.micro.linears import _kernel_pass, _packed, _shapes, medians_in_turn

# (layers, hidden, intermediate, heads, kv heads, head dim, vocab)
SHAPES = {"smollm2": (30, 576, 1536, 9, 3, 64, 49152), "1b": (4, 2048, 8192, 32, 8, 64, 128256),
          "8b": (2, 4096, 14336, 32, 8, 128, 128256)}


def with_defines(source: str, changes: dict[str, str]) -> str:
    """`source` with each `#define NAME ...` line of `changes` given its new value (its comment kept)."""
    for name, value in changes.items():
        pattern = re.compile(rf"^(#define {re.escape(name)}) +(\S+)", re.MULTILINE)
        if not pattern.search(source):
            raise ValueError(f"no `#define {name}` in the sources")
        source = pattern.sub(lambda m, value=value: f"{m.group(1)} {value}", source, count=1)
    return source


def parse_variant(text: str) -> dict[str, str]:
    """NAME=VALUE[,NAME=VALUE...] -> {NAME: VALUE}."""
    pairs = [item.split("=", 1) for item in text.split(",")]
    if any(len(pair) != 2 or not pair[0] or not pair[1] for pair in pairs):
        raise ValueError(f"a variant is NAME=VALUE[,NAME=VALUE...], got {text!r}")
    return dict(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, threads=2, repeats=5)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[64, 128, 256])
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    help="NAME=VALUE[,NAME=VALUE...]: #defines of csrc/linears.c to change (repeatable)")
    ap.add_argument("--baseline", metavar="REF", help="also time git REF's kernels")
    args = ap.parse_args(argv)
    if not cpu_linears.has_panel_linears():
        print("batchrun's panel kernels are not available here (no compiler, or a CPU without AVX-512 or AVX2)")
        return 1
    torch.set_num_threads(args.threads)
    sources = cpu_kernels.sources()
    libs = {"current": cpu_linears._library()}
    for changes in args.variant:
        files = {**sources, "linears.c": with_defines(sources["linears.c"].decode(), changes).encode()}
        libs[",".join(f"{k}={v}" for k, v in changes.items())] = cpu_kernels.build(files, cpu_linears.SIGNATURES)
    if args.baseline:
        libs[args.baseline] = cpu_kernels.build(revision_source(args.baseline), cpu_linears.SIGNATURES)
    layers, hidden, inter, heads, kv_heads, head_dim, vocab = SHAPES[args.shape]
    shapes = [s for _ in range(layers) for s in _shapes(hidden, inter, heads, kv_heads, head_dim)] + [(vocab, hidden)]
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16) for n, k in shapes]
    packs = {name: [_packed(lib, w) for w in weights] for name, lib in libs.items()}
    matmuls = [OneDNNLinear(nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16))._matmul
               for w in weights]
    print(f"{args.shape}'s bf16 linears, threads {args.threads}, median of {args.repeats} rounds, ms (/ oneDNN)")
    with torch.no_grad():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for k in {w.shape[1] for w in weights}}
            y = torch.empty(rows, max(w.shape[0] for w in weights), dtype=torch.bfloat16)
            def one_pass(name: str, xs: dict = xs, y: torch.Tensor = y) -> None:
                if name == "oneDNN":
                    for w, matmul in zip(weights, matmuls):
                        matmul(xs[w.shape[1]])
                else:
                    _kernel_pass(libs[name], packs[name], weights, xs, y, True)

            med = medians_in_turn([*libs, "oneDNN"], one_pass, args.repeats)
            print(f"rows {rows:5d}: " + "  ".join(f"{name} {1e3 * s:.2f} ({s / med['oneDNN']:.2f})"
                                                  for name, s in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
