"""The quantized CPU linears beside bf16: `python -m benchmarks.micro.quant_linears [--rows 1,8,16,64] [--formats ...]`.

Times one pass over a model's layer linears (q|k|v, o, gate|up, down; --layers distinct copies, so that the
weights stream from memory as in a decode step) at each row count, bf16 activations in and out, through
  - bf16: the engine's default bf16 path (model/layers/linear.py: OneDNNLinear: oneDNN's reordered weights, and batchrun's
    few-row panels up to cpu_kernels.linears.SMALL_ROWS rows);
  - bf16-panels: batchrun's bf16 panels at every row count (model/layers/linear.py: PackedLinear): what a bf16 model runs on
    where oneDNN has no bf16 kernels (a CPU without AVX512-BF16 or AMX: the AVX2 CPUs of --march x86-64-v3);
  - int8, int4, int4-g32: model/quant/linear.py: QuantLinear (csrc/quant_linears.c) on the weights quantized as the engine
    quantizes them (EngineArgs.quantization), on the vector kernel this build has (VNNI, AVX2);
  - int8-plain, int4-plain, ...: the same linears (the same packed weights, held once) on the plain C loop.
--march builds the C library for another target than this CPU (BATCHRUN_CPU_MARCH): x86-64-v3 times the AVX2
kernels on an AVX-512 machine (pair it with bf16-panels; oneDNN still picks its kernels by the CPU itself).
The lm_head is left out: it stays bf16 in every format. The systems run in turn within each of --repeats rounds,
each figure the median of its rounds; the ratio to the first format (bf16 by default) is what to read (the
decode targets: int8 >= 1.7x, int4 >= 2.5x bf16's speed). The shapes default to SmolLM2-135M's; --preset
llama-1b takes Llama-3.2-1B's (16 layers of hidden 2048, MLP 8192: 2.4 GB of bf16 weights, 3.6 GB held with the
quantized copies).
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch
from torch import nn

from batchrun.kernels.cpu import quant as quant_kernels
from batchrun.model.layers.linear import OneDNNLinear, PackedLinear
from batchrun.model.quant.linear import QuantSpec, quantize_linear
from benchmarks.harness.cli_args import parser
from benchmarks.micro.linears import _shapes

PRESETS = {"smollm2": dict(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64),
           "llama-1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64)}


def _modules(fmt: str, shapes: list[tuple[int, int]], seed: int) -> list[nn.Module]:
    """The linears of `shapes` in format `fmt`, each made from its own seeded random bf16 weight (the same
    weights for every format), one at a time so that the plain weights are not all held at once."""
    spec = None if fmt.startswith("bf16") else QuantSpec.parse(fmt)
    out = []
    for i, (n, k) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed + i)
        linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
        if spec is not None:
            out.append(quantize_linear(linear, spec))
        else:
            out.append(PackedLinear(linear) if fmt == "bf16-panels" else OneDNNLinear(linear))
    return out


def _on_plain_loop(modules: list[nn.Module]) -> list[nn.Module]:
    """Copies of quantized linears that share their packed weights and run on the plain C loop."""
    out = []
    for m in modules:
        m = copy.copy(m)
        m.plain = True
        out.append(m)
    return out


def weight_bytes(module: nn.Module) -> int:
    if isinstance(module, (OneDNNLinear, PackedLinear)):
        return module.in_features * module.out_features * 2
    return module.nbytes


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, threads=2, repeats=5)
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 16, 64],
                    help="row counts, comma-separated (default 1,8,16,64)")
    ap.add_argument("--formats", default="bf16,int8,int4,int4-g32", help="comma-separated (default %(default)s)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    ap.add_argument("--march", default=None,
                    help="build the C kernels for this -march (BATCHRUN_CPU_MARCH), e.g. x86-64-v3 for AVX2")
    args = ap.parse_args(argv)
    if args.march:  # before anything builds the library (it is built on first use)
        os.environ["BATCHRUN_CPU_MARCH"] = args.march
    if not quant_kernels.available():
        print("batchrun's C kernels are not built here (no C compiler)")
        return 1
    torch.set_num_threads(args.threads)
    p = dict(PRESETS[args.preset])
    layers = args.layers or p.pop("layers")
    p.pop("layers", None)
    shapes = [s for _ in range(layers) for s in _shapes(p["hidden"], p["intermediate"], p["heads"], p["kv_heads"],
                                                        p["head_dim"])]
    formats = args.formats.split(",")
    modules: dict[str, list[nn.Module]] = {}
    for fmt in formats:
        plain = fmt.endswith("-plain")
        base = fmt.removesuffix("-plain")
        if base not in modules:
            modules[base] = _modules(base, shapes, seed=0)
        if plain:
            modules[fmt] = _on_plain_loop(modules[base])
    modules = {fmt: modules[fmt] for fmt in formats}  # a base format made only for its -plain copies goes
    print(f"{args.preset}: {layers} layers, threads {args.threads}, march "
          f"{os.environ.get('BATCHRUN_CPU_MARCH') or 'native'}, kernel {quant_kernels.kernel()}, median of "
          f"{args.repeats} rounds; weights " + ", ".join(
              f"{fmt} {sum(weight_bytes(m) for m in ms) / 2**20:.0f} MiB" for fmt, ms in modules.items()
              if not fmt.endswith("-plain")))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=g).to(torch.bfloat16) for _, k in shapes}
            times: dict[str, list[float]] = {fmt: [] for fmt in formats}
            for r in range(args.repeats):
                for fmt in formats[:: 1 if r % 2 == 0 else -1]:  # alternate the order between rounds
                    t = time.perf_counter()
                    for m, (_, k) in zip(modules[fmt], shapes):
                        m(xs[k])
                    times[fmt].append(time.perf_counter() - t)
            med = {fmt: statistics.median(ts) for fmt, ts in times.items()}
            base = med[formats[0]]
            cells = [f"{fmt} {1e3 * t:7.2f} ms" + (f" ({base / t:4.2f}x)" if fmt != formats[0] else "")
                     for fmt, t in med.items()]
            print(f"rows {rows:4d}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
