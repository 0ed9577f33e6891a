"""The CPU's multiply-add ceilings per core for the instructions batchrun's linears run on: `python -m
benchmarks.micro.isa_peak`.

Times chains of independent AVX-512 multiply-adds in registers (16 accumulators, nothing read from memory) on one
thread, for the instructions behind each weight format: vpdpbusd (int8 x int8 -> int32, 64 multiply-adds per zmm:
the quantized kernels, csrc/quant_linears.c), vdpbf16ps (bf16 pairs -> fp32, 32: bf16 linears without AMX) and
vfmadd231ps (fp32, 16), and on a CPU with AMX the tile product tdpbf16ps (bf16, 8192 a tile product: the bf16
linears' kernel there) into four tiles of sums. Their ratio is the most a format's compute-bound steps (many rows
per step) can gain over another on this CPU, whatever the bytes per weight: e.g. where vpdpbusd does twice vdpbf16ps's multiply-adds, an
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
/* tdpbf16ps into four C tiles from two operand tiles (16 x 16 x 32 multiply-adds each), nothing read after the
 * first loads; Linux grants the tile state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA). */
static void amx_peak(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    static char operand[1024] __attribute__((aligned(64)));
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
    _tile_loadd(6, operand, 64); _tile_loadd(7, operand, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const long iters = ITERS / 4;
    double t = now();
    for (long it = 0; it < iters; it++) {
        _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7); _tile_dpbf16ps(3, 6, 7);
    }
    t = now() - t;
    _tile_release();
    printf("tdpbf16ps %.3f %.1f\n", 4 * iters / t / 1e9, 4 * iters * 16.0 * 16 * 32 / t / 1e9);
}
#endif
int main(void) {
    RUN("vpdpbusd", __m512i, _mm512_set1_epi8(1), _mm512_dpbusd_epi32(a[i], w, w), 64);
    RUN("vdpbf16ps", __m512, _mm512_set1_ps(1), _mm512_dpbf16_ps(a[i], (__m512bh)w, (__m512bh)w), 32);
    RUN("vfmadd231ps", __m512, _mm512_set1_ps(1), _mm512_fmadd_ps(a[i], w, w), 16);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    amx_peak();
#endif
    return 0;
}
"""
FORMATS = {"vpdpbusd": "int8 (quantized kernels)", "vdpbf16ps": "bf16 (no AMX)", "vfmadd231ps": "fp32",
           "tdpbf16ps": "bf16 AMX tiles (linears)"}


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


def measure_here() -> dict[str, tuple[float, float]]:
    """measure(), or {} where its loops cannot run here (no C compiler, no AVX-512 VNNI / BF16)."""
    try:
        return measure()
    except (RuntimeError, OSError, subprocess.CalledProcessError, ValueError):
        return {}


def linear_flops(threads: int) -> dict[str, float]:
    """FLOP/s (2 per multiply-add) of the instruction each dtype's linears run on here, `threads` times one core's:
    fp32 vfmadd231ps, bf16 tdpbf16ps on AMX else vdpbf16ps. {} where the loops cannot run (no C compiler, no
    AVX-512 VNNI / BF16)."""
    per_core = measure_here()
    bf16 = per_core.get("tdpbf16ps") or per_core.get("vdpbf16ps")
    flops = {"float32": per_core.get("vfmadd231ps"), "bfloat16": bf16}
    return {dtype: 2e9 * macs * threads for dtype, (_, macs) in ((d, v) for d, v in flops.items() if v)}


def main() -> int:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if "avx512_vnni" not in flags or "avx512_bf16" not in flags:
        print("this CPU lacks AVX512-VNNI or AVX512_BF16: nothing to measure")
        return 1
    peaks = measure()
    base = peaks["vdpbf16ps"][1]
    print("one core, independent chains in registers (16 vectors; 4 tiles):")
    for name, (instructions, macs) in peaks.items():
        print(f"  {name:12s} {FORMATS[name]:26s} {instructions:5.2f} G instr/s  {macs:6.1f} G multiply-adds/s "
              f"({macs / base:.2f}x bf16)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
