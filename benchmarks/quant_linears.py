"""The quantized CPU linears beside bf16: `python -m benchmarks.quant_linears [--rows 1,8,16,64] [--formats ...]`.

Times one pass over a model's layer linears (q|k|v, o, gate|up, down; --layers distinct copies, so that the
weights stream from memory as in a decode step) at each row count, bf16 activations in and out, through
  - bf16: the engine's default bf16 path (cpu_linear.OneDNNLinear: oneDNN's reordered weights, and batchrun's
    few-row panels up to cpu_kernels.linears.SMALL_ROWS rows);
  - int8, int4, int4-g32: quant_linear.QuantLinear (csrc/quant_linears.c) on the weights quantized as the engine
    quantizes them (EngineArgs.quantization).
The lm_head is left out: it stays bf16 in every format. The systems run in turn within each of --repeats rounds,
each figure the median of its rounds; the ratio to bf16 is what to read (issue 33's decode targets: int8 >= 1.7x,
int4 >= 2.5x bf16's speed). The shapes default to SmolLM2-135M's; --preset llama-1b takes Llama-3.2-1B's (16
layers of hidden 2048, MLP 8192: 2.4 GB of bf16 weights, 3.6 GB held with the quantized copies).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from batchrun.model.cpu_kernels import quant as quant_kernels
from batchrun.model.cpu_linear import OneDNNLinear
from batchrun.model.quant_linear import QuantSpec, quantize_linear
from benchmarks.cli_args import parser
from benchmarks.linears import _shapes

PRESETS = {"smollm2": dict(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64),
           "llama-1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64)}


def _modules(fmt: str, shapes: list[tuple[int, int]], seed: int) -> list[nn.Module]:
    """The linears of `shapes` in format `fmt`, each made from its own seeded random bf16 weight (the same
    weights for every format), one at a time so that the plain weights are not all held at once."""
    spec = QuantSpec.parse(fmt if fmt != "bf16" else "none")
    out = []
    for i, (n, k) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed + i)
        linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g) * k**-0.5)
        out.append(OneDNNLinear(linear) if spec is None else quantize_linear(linear, spec))
    return out


def weight_bytes(module: nn.Module) -> int:
    if isinstance(module, OneDNNLinear):
        return module.in_features * module.out_features * 2
    return module.nbytes


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, threads=2, repeats=5)
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 8, 16, 64],
                    help="row counts, comma-separated (default 1,8,16,64)")
    ap.add_argument("--formats", default="bf16,int8,int4,int4-g32", help="comma-separated (default %(default)s)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="smollm2")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    args = ap.parse_args(argv)
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
    modules = {fmt: _modules(fmt, shapes, seed=0) for fmt in formats}
    print(f"{args.preset}: {layers} layers, threads {args.threads}, kernel {quant_kernels.kernel()}, median of "
          f"{args.repeats} rounds; weights " + ", ".join(
              f"{fmt} {sum(weight_bytes(m) for m in ms) / 2**20:.0f} MiB" for fmt, ms in modules.items()))
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
            base = med.get("bf16")
            cells = [f"{fmt} {1e3 * t:7.2f} ms" + (f" ({base / t:4.2f}x)" if base and fmt != "bf16" else "")
                     for fmt, t in med.items()]
            print(f"rows {rows:4d}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
