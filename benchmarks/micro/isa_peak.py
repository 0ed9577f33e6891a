"""The CPU's multiply-add ceilings per core for the instructions batchrun's linears run on: `python -m
benchmarks.micro.isa_peak`.

Times chains of independent AVX-512 multiply-adds in registers (16 accumulators, nothing read from memory) on one
thread, for the instructions behind each weight format: vpdpbusd (int8 x int8 -> int32, 64 multiply-adds per zmm:
the quantized kernels, csrc/quant_linears.c), vdpbf16ps (bf16 pairs -> fp32, 32: bf16 linears without AMX) and
vfmadd231ps (fp32, 16). Their ratio is the most a format's compute-bound steps (many rows per step) can gain over
another on this CPU, whatever the bytes per weight: e.g. where vpdpbusd does twice vdpbf16ps's multiply-adds, an
int8 linear at 64 rows is at most 2x a bf16 one. Needs a C compiler and AVX512-VNNI and AVX512_BF16."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define CHAINS 16
#define ITERS 50000000L
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
#define RUN(name, T, init, op, macs) do { \
    T a[CHAINS]; T w = init; for (int i = 0; i < CHAINS; i++) a[i] = init; \
    double t = now(); \
    for (long it = 0; it < ITERS; it++) { \
        _Pragma("GCC unroll 16") for (int i = 0; i < CHAINS; i++) a[i] = op; \
        __asm__ volatile("" : "+v"(w)); \
    } \
    t = now() - t; \
    for (int i = 0; i < CHAINS; i++) __asm__ volatile("" : : "v"(a[i])); \
    printf("%s %.3f %.1f\n", name, ITERS * CHAINS / t / 1e9, ITERS * CHAINS * (double)(macs) / t / 1e9); \
} while (0)
int main(void) {
    RUN("vpdpbusd", __m512i, _mm512_set1_epi8(1), _mm512_dpbusd_epi32(a[i], w, w), 64);
    RUN("vdpbf16ps", __m512, _mm512_set1_ps(1), _mm512_dpbf16_ps(a[i], (__m512bh)w, (__m512bh)w), 32);
    RUN("vfmadd231ps", __m512, _mm512_set1_ps(1), _mm512_fmadd_ps(a[i], w, w), 16);
    return 0;
}
"""
FORMATS = {"vpdpbusd": "int8 (quantized kernels)", "vdpbf16ps": "bf16 (no AMX)", "vfmadd231ps": "fp32"}


def measure() -> dict[str, tuple[float, float]]:
    """{instruction: (G instructions/s, G multiply-adds/s)} on one core."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run([cc, "-O3", "-march=native", str(src), "-o", str(exe)], check=True, capture_output=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: (float(a), float(b)) for name, a, b in (line.split() for line in out.splitlines())}


def main() -> int:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if "avx512_vnni" not in flags or "avx512_bf16" not in flags:
        print("this CPU lacks AVX512-VNNI or AVX512_BF16: nothing to measure")
        return 1
    peaks = measure()
    base = peaks["vdpbf16ps"][1]
    print("one core, 16 independent chains in registers:")
    for name, (instructions, macs) in peaks.items():
        print(f"  {name:12s} {FORMATS[name]:26s} {instructions:5.2f} G instr/s  {macs:6.1f} G multiply-adds/s "
              f"({macs / base:.2f}x bf16)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
