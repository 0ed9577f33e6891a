/* Weight-only quantized linears y = x W^T + bias on int8 and int4 weights (batchrun/model/quant.py's layout:
 * w = q * scale[o, g] for 8 bits, w = q * scale[o, g] + offset[o, g] for 4 bits, g = i / group_size, any group
 * size that divides k), with the activations quantized on the fly (W8A8) per row and group of the kernel's `gs`
 * inputs (gs divides the weights' group wgs: a weight group's scale serves wgs / gs of them): x[r, i] ~ xs[r, g] *
 * xq[r, i], xq in -127..127, xs[r, g] = max_{i in g} |x[r, i]| / 127. Then
 *     y[r, o] = sum_g xs[r, g] ( scale[o, g] sum_{i in g} q[o, i] xq[r, i]  (+ offset[o, g] sum_{i in g} xq[r, i]) )
 * with the inner sums exact in int32 and the rest fp32. A scale per group (of 32: cpu_kernels/quant.py,
 * ACTIVATION_GROUP) rather than per row: SmolLM2's activations have a few channels far larger than the rest, and
 * one scale per row cost int8 a tenth of its top-1 agreement with bf16 (89.7%, where groups of 32 keep 97.7%;
 * docs/quantization.md).
 *
 * Why: a decode step streams every weight once, so its time is the weights' bytes: int8 is half of bf16's and
 * int4 a quarter. Quantizing the few activation rows costs rows x k, next to the n x k weights it saves.
 *
 * Layout (pack_int8_linear, pack_int4_linear, once at load): panels of QP = 32 outputs (two 16-lane vectors),
 * zero past n. int8: packed[p][i / 4][j][i % 4] = q + 128 (unsigned; a 4-byte dword per output per 4 inputs: what
 * vpdpbusd multiplies), 128 bytes per 4 inputs of a panel. int4: packed[p][i / 8][j][i % 4], the low nibble input
 * 8t + b, the high nibble input 8t + 4 + b: one 64-byte load gives two k-steps of 16 outputs, split by a mask and a
 * shift. Beside them per panel and weight group: the QP scales (fp32), and for int4 the QP offsets (fp32).
 *
 * On CPUs with AVX512-VNNI (vpdpbusd: unsigned bytes times signed bytes, four products summed into each int32
 * lane) the weights are the unsigned operand and the activations the signed one: int4's nibbles as they are,
 * int8's biased by 128, whose 128 * sum xq (the activations' group sums, computed with them) comes back off.
 * Elsewhere a plain C loop over the same layout computes the same integer sums (and the same fp32 sums: both go
 * group by group in order).
 *
 * Threads: the panels are split over the OpenMP threads (static schedule), so each weight byte is read once per
 * call by one thread; the rows go in tiles of QROWS, each tile's integer and fp32 sums in registers. */
#include "common.h"

#define QP 32    /* outputs per panel */
#define QROWS 4  /* rows per register tile */
#define QPREFETCH 6144 /* bytes ahead of the panel's stream that a tile prefetches */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

/* The outputs per panel of the packed layout (the Python side sizes its buffers with it). */
int quant_linear_panel(void) { return QP; }
/* Whether the AVX512-VNNI kernel is compiled in (the CPU has it: the library is built with -march=native). */
int quant_vnni(void) { return HAVE_VNNI; }

/* int8 [n, k] weights and fp32 [n, k / gs] scales -> the panel layout (see the top of the file). */
void pack_int8_linear(const int8_t *q, const float *scale, int64_t n, int64_t k, int64_t gs, uint8_t *packed,
                      float *pscale) {
    const int64_t panels = (n + QP - 1) / QP, groups = k / gs;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < QP; j++) {
            const int64_t o = p * QP + j;
            uint8_t *dst = packed + p * k * QP + j * 4;
            for (int64_t i = 0; i < k; i++) dst[i / 4 * QP * 4 + i % 4] = (uint8_t)((o < n ? q[o * k + i] : 0) + 128);
            for (int64_t g = 0; g < groups; g++) pscale[(p * groups + g) * QP + j] = o < n ? scale[o * groups + g] : 0.0f;
        }
}

/* uint8 [n, k / 2] nibbles (input 2m in the low nibble of byte m), fp32 [n, k / gs] scales and offsets -> the
 * panel layout (see the top of the file). */
void pack_int4_linear(const uint8_t *q, const float *scale, const float *offset, int64_t n, int64_t k, int64_t gs,
                      uint8_t *packed, float *pscale, float *poffset) {
    const int64_t panels = (n + QP - 1) / QP, groups = k / gs;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < QP; j++) {
            const int64_t o = p * QP + j;
            uint8_t *dst = packed + p * (k / 2) * QP + j * 4;
            for (int64_t t = 0; t < k / 8; t++)
                for (int64_t b = 0; b < 4; b++) {
                    const int64_t lo = 8 * t + b, hi = lo + 4;
                    const uint8_t vlo = o < n ? (q[o * (k / 2) + lo / 2] >> (4 * (lo & 1))) & 15 : 0;
                    const uint8_t vhi = o < n ? (q[o * (k / 2) + hi / 2] >> (4 * (hi & 1))) & 15 : 0;
                    dst[t * QP * 4 + b] = (uint8_t)(vlo | (vhi << 4));
                }
            for (int64_t g = 0; g < groups; g++) {
                pscale[(p * groups + g) * QP + j] = o < n ? scale[o * groups + g] : 0.0f;
                poffset[(p * groups + g) * QP + j] = o < n ? offset[o * groups + g] : 0.0f;
            }
        }
}

/* Row r of x (fp32 or bf16) -> xq[r] (-127..127, as int8),
 * per group of gs inputs its scale xs[r][g] = max |x| / 127 (0 for a zero group) and the sum of its xq (without
 * the bias) xsum[r][g]. rint: round to nearest even, as torch.round (the tests emulate it). */
ALWAYS void quantize_row(const void *x, int64_t r, int64_t k, int64_t gs, uint8_t *xq, float *xs,
                         int32_t *xsum, const int bf) {
    const void *row = at(x, r * k, bf);
    uint8_t *dst = xq + r * k;
    for (int64_t g = 0; g < k / gs; g++) {
        const int64_t end = (g + 1) * gs;
        int64_t i = g * gs;
        vf mv = vsplat(0.0f);
        for (; i + VW <= end; i += VW) {
            const vf v = ldv(row, i, bf);
            const vf a = vselect(v < 0.0f, -v, v);
            mv = vselect(a > mv, a, mv);
        }
        float m = 0.0f;
        for (int j = 0; j < VW; j++) m = fmaxf(m, mv[j]);
        for (; i < end; i++) m = fmaxf(m, fabsf(ld1(row, i, bf)));
        const float inv = m > 0.0f ? 127.0f / m : 0.0f;
        xs[r * (k / gs) + g] = m / 127.0f;
        int32_t s = 0;
        i = g * gs;
        /* |x * inv| <= 127 up to rounding: the clamp only catches that rounding */
        for (; i + VW <= end; i += VW) {
            const vf v = ldv(row, i, bf) * inv;
            vi qi;
            for (int j = 0; j < VW; j++) {
                const float c = v[j] > 127.0f ? 127.0f : v[j] < -127.0f ? -127.0f : v[j];
                qi[j] = (int32_t)rintf(c);
            }
            for (int j = 0; j < VW; j++) {
                s += qi[j];
                dst[i + j] = (uint8_t)(int8_t)qi[j];
            }
        }
        for (; i < end; i++) {
            float v = ld1(row, i, bf) * inv;
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            const int32_t qi = (int32_t)rintf(v);
            s += qi;
            dst[i] = (uint8_t)(int8_t)qi;
        }
        xsum[r * (k / gs) + g] = s;
    }
}

static void quantize_rows(const void *x, int64_t rows, int64_t k, int64_t gs, uint8_t *xq, float *xs, int32_t *xsum,
                          int bf) {
#pragma omp parallel for if (rows * k > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) BY_DTYPE(bf, quantize_row, x, r, k, gs, xq, xs, xsum);
}

/* The finished outputs of one row: acc[j] (fp32, the QP outputs from col) plus the bias, stored in the output
 * dtype; only the first `left` when the panel is the last one. */
static void store_row(const float *acc, int64_t left, const void *bias, int64_t col, void *y, int ybf) {
    const int64_t m = left < QP ? left : QP;
    for (int64_t j = 0; j < m; j++) {
        float v = acc[j];
        if (bias != NULL) v += ld1(bias, col + j, ybf);
        st1(y, col + j, v, ybf);
    }
}

/* The plain C kernel: rows [r0, r0 + rows) of one panel (int8 weights stored q + 128: the 128 comes off each). */
static void tile_plain(int64_t rows, int64_t r0, const uint8_t *xq, const int32_t *xsum, const float *xs, int64_t k,
                       int64_t gs, int64_t per, int bits, const uint8_t *panel, const float *pscale,
                       const float *poffset, const void *bias, int64_t col, int64_t n, void *y, int ybf) {
    const int64_t groups = k / gs;
    for (int64_t r = r0; r < r0 + rows; r++) {
        const int8_t *xr = (const int8_t *)xq + r * k;
        float acc[QP] = {0};
        for (int64_t g = 0; g < groups; g++) {
            int32_t isum[QP] = {0};
            for (int64_t i = g * gs; i < (g + 1) * gs; i++) {
                const int32_t xv = xr[i];
                if (bits == 8) {
                    const uint8_t *w = panel + i / 4 * QP * 4 + i % 4;
                    for (int j = 0; j < QP; j++) isum[j] += xv * ((int32_t)w[4 * j] - 128);
                } else {
                    const uint8_t *w = panel + i / 8 * QP * 4 + i % 4;
                    const int shift = (i % 8) >= 4 ? 4 : 0;
                    for (int j = 0; j < QP; j++) isum[j] += xv * ((w[4 * j] >> shift) & 15);
                }
            }
            const float *s = pscale + g / per * QP;
            const float xsg = xs[r * groups + g];
            for (int j = 0; j < QP; j++) acc[j] += (float)isum[j] * (s[j] * xsg);
            if (bits == 4) {
                const float *off = poffset + g / per * QP;
                const float xg = (float)xsum[r * groups + g] * xsg;
                for (int j = 0; j < QP; j++) acc[j] += off[j] * xg;
            }
        }
        store_row(acc, n - col, bias, col, at(y, r * n, ybf), ybf);
    }
}

#if HAVE_VNNI
/* AVX512-VNNI: R rows (a constant, 1..QROWS) of one panel; int32 sums per activation group, fp32 across groups.
 * The weights are the unsigned operand, x the signed one: int8's stored q + 128, so 128 * sum xq comes off each
 * group's sum; int4's nibbles as they are, with offset * sum xq added per group. */
ALWAYS void tile_vnni(const int R, int64_t r0, const uint8_t *xq, const int32_t *xsum, const float *xs, int64_t k,
                      int64_t gs, int64_t per, const int bits, const uint8_t *panel, const float *pscale,
                      const float *poffset, const void *bias, int64_t col, int64_t n, void *y, int ybf) {
    const int64_t groups = k / gs;
    const __m512i low4 = _mm512_set1_epi8(15);
    __m512 acc[QROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i is[QROWS][2];
        for (int r = 0; r < R; r++) is[r][0] = is[r][1] = _mm512_setzero_si512();
        /* one or two rows: a second set of sums (js), so that the chain of dependent vpdpbusd is half as long
         * (with 2 chains per row their latency, not the weights' stream, set the pace) */
        __m512i js[2][2];
        for (int r = 0; r < (R <= 2 ? R : 0); r++) js[r][0] = js[r][1] = _mm512_setzero_si512();
        if (bits == 8) {
            int64_t t = g * gs / 4;
            const int64_t te = (g + 1) * gs / 4;
            for (; R <= 2 && t + 1 < te; t += 2) {
                const uint8_t *w = panel + t * 128;
                _mm_prefetch((const char *)w + QPREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)w + QPREFETCH + 64, _MM_HINT_T0);
                _mm_prefetch((const char *)w + QPREFETCH + 128, _MM_HINT_T0);
                _mm_prefetch((const char *)w + QPREFETCH + 192, _MM_HINT_T0);
                const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
                const __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
                for (int r = 0; r < (R <= 2 ? R : 0); r++) {
                    int32_t xa, xb;
                    memcpy(&xa, xq + (r0 + r) * k + 4 * t, 4);
                    memcpy(&xb, xq + (r0 + r) * k + 4 * t + 4, 4);
                    const __m512i ba = _mm512_set1_epi32(xa), bb = _mm512_set1_epi32(xb);
                    is[r][0] = _mm512_dpbusd_epi32(is[r][0], w0, ba);
                    is[r][1] = _mm512_dpbusd_epi32(is[r][1], w1, ba);
                    js[r][0] = _mm512_dpbusd_epi32(js[r][0], w2, bb);
                    js[r][1] = _mm512_dpbusd_epi32(js[r][1], w3, bb);
                }
            }
            for (; t < te; t++) {
                const uint8_t *w = panel + t * 128;
                _mm_prefetch((const char *)w + QPREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)w + QPREFETCH + 64, _MM_HINT_T0);
                const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
                for (int r = 0; r < R; r++) {
                    int32_t xv;
                    memcpy(&xv, xq + (r0 + r) * k + 4 * t, 4);
                    const __m512i xb = _mm512_set1_epi32(xv);
                    is[r][0] = _mm512_dpbusd_epi32(is[r][0], w0, xb);
                    is[r][1] = _mm512_dpbusd_epi32(is[r][1], w1, xb);
                }
            }
        } else {
            for (int64_t t = g * gs / 8; t < (g + 1) * gs / 8; t++) {
                const uint8_t *w = panel + t * 128;
                _mm_prefetch((const char *)w + QPREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)w + QPREFETCH + 64, _MM_HINT_T0);
                const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 64);
                const __m512i lo0 = _mm512_and_si512(v0, low4), lo1 = _mm512_and_si512(v1, low4);
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
                for (int r = 0; r < R; r++) {
                    int32_t xa, xb;
                    memcpy(&xa, xq + (r0 + r) * k + 8 * t, 4);
                    memcpy(&xb, xq + (r0 + r) * k + 8 * t + 4, 4);
                    const __m512i ba = _mm512_set1_epi32(xa), bb = _mm512_set1_epi32(xb);
                    is[r][0] = _mm512_dpbusd_epi32(is[r][0], lo0, ba);
                    is[r][1] = _mm512_dpbusd_epi32(is[r][1], lo1, ba);
                    if (R <= 2) {
                        js[r % 2][0] = _mm512_dpbusd_epi32(js[r % 2][0], hi0, bb);
                        js[r % 2][1] = _mm512_dpbusd_epi32(js[r % 2][1], hi1, bb);
                    } else {
                        is[r][0] = _mm512_dpbusd_epi32(is[r][0], hi0, bb);
                        is[r][1] = _mm512_dpbusd_epi32(is[r][1], hi1, bb);
                    }
                }
            }
        }
        for (int r = 0; r < (R <= 2 ? R : 0); r++) {
            is[r][0] = _mm512_add_epi32(is[r][0], js[r % 2][0]);
            is[r][1] = _mm512_add_epi32(is[r][1], js[r % 2][1]);
        }
        const float *sg = pscale + g / per * QP;
        const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
        if (bits == 8) {
            for (int r = 0; r < R; r++) {
                const __m512i c0 = _mm512_set1_epi32(128 * xsum[(r0 + r) * groups + g]), c1 = c0;
                const __m512 xsg = _mm512_set1_ps(xs[(r0 + r) * groups + g]);
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(is[r][0], c0)),
                                            _mm512_mul_ps(s0, xsg), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(is[r][1], c1)),
                                            _mm512_mul_ps(s1, xsg), acc[r][1]);
            }
        } else {
            const float *off = poffset + g / per * QP;
            const __m512 o0 = _mm512_loadu_ps(off), o1 = _mm512_loadu_ps(off + 16);
            for (int r = 0; r < R; r++) {
                const float xsg1 = xs[(r0 + r) * groups + g];
                const __m512 xsg = _mm512_set1_ps(xsg1);
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][0]), _mm512_mul_ps(s0, xsg), acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][1]), _mm512_mul_ps(s1, xsg), acc[r][1]);
                const __m512 xg = _mm512_set1_ps((float)xsum[(r0 + r) * groups + g] * xsg1);
                acc[r][0] = _mm512_fmadd_ps(o0, xg, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(o1, xg, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float out[QP];
        _mm512_storeu_ps(out, acc[r][0]);
        _mm512_storeu_ps(out + 16, acc[r][1]);
        store_row(out, n - col, bias, col, at(y, (r0 + r) * n, ybf), ybf);
    }
}

/* One panel's rows in tiles of QROWS, each tile size its own unrolled copy (R a constant). */
ALWAYS void panel_vnni(int64_t rows, const uint8_t *xq, const int32_t *xsum, const float *xs, int64_t k, int64_t gs,
                       int64_t per, const int bits, const uint8_t *panel, const float *pscale, const float *poffset,
                       const void *bias, int64_t col, int64_t n, void *y, int ybf) {
    int64_t r0 = 0;
    for (; r0 + QROWS <= rows; r0 += QROWS)
        tile_vnni(QROWS, r0, xq, xsum, xs, k, gs, per, bits, panel, pscale, poffset, bias, col, n, y, ybf);
    switch (rows - r0) {
    case 3: tile_vnni(3, r0, xq, xsum, xs, k, gs, per, bits, panel, pscale, poffset, bias, col, n, y, ybf); break;
    case 2: tile_vnni(2, r0, xq, xsum, xs, k, gs, per, bits, panel, pscale, poffset, bias, col, n, y, ybf); break;
    case 1: tile_vnni(1, r0, xq, xsum, xs, k, gs, per, bits, panel, pscale, poffset, bias, col, n, y, ybf); break;
    default: break;
    }
}
static void panel_vnni8(int64_t rows, const uint8_t *xq, const int32_t *xsum, const float *xs, int64_t k, int64_t gs,
                        int64_t per, const uint8_t *panel, const float *pscale, const float *poffset, const void *bias,
                        int64_t col, int64_t n, void *y, int ybf) {
    panel_vnni(rows, xq, xsum, xs, k, gs, per, 8, panel, pscale, poffset, bias, col, n, y, ybf);
}
static void panel_vnni4(int64_t rows, const uint8_t *xq, const int32_t *xsum, const float *xs, int64_t k, int64_t gs,
                        int64_t per, const uint8_t *panel, const float *pscale, const float *poffset, const void *bias,
                        int64_t col, int64_t n, void *y, int ybf) {
    panel_vnni(rows, xq, xsum, xs, k, gs, per, 4, panel, pscale, poffset, bias, col, n, y, ybf);
}
#endif

/* y [rows, n] (ybf: bf16, else fp32) = x [rows, k] (xbf: bf16, else fp32; contiguous) times the packed weight
 * (bits 8 or 4, scales and int4 offsets per group of wgs inputs) plus bias (NULL or [n], y's dtype), the
 * activations quantized per group of gs inputs (gs divides wgs). plain: the C loop even where VNNI is there (tests
 * hold the two to the same sums). Needs k, gs in multiples of 4 for int8, of 8 for int4 (the Python side checks).
 * Returns 1 when the scratch for the quantized rows cannot be allocated, else 0. */
int quant_linear(const void *x, int64_t rows, int64_t k, int xbf, const uint8_t *packed, const float *pscale,
                 const float *poffset, int64_t n, int64_t wgs, int64_t gs, int bits, const void *bias, void *y, int ybf,
                 int plain) {
    if (rows <= 0) return 0;
    const int vnni = HAVE_VNNI && !plain;
    const int64_t groups = k / gs, wgroups = k / wgs, per = wgs / gs, panels = (n + QP - 1) / QP;
    const int64_t panel_bytes = bits == 8 ? k * QP : k / 2 * QP;
    uint8_t *xq = malloc((size_t)(rows * k));
    float *xs = malloc(sizeof(float) * (size_t)(rows * groups));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(rows * groups));
    if (xq == NULL || xs == NULL || xsum == NULL) {
        free(xq), free(xs), free(xsum);
        return 1;
    }
    quantize_rows(x, rows, k, gs, xq, xs, xsum, xbf);
#pragma omp parallel for schedule(static) if (rows * n * k > PAR_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *panel = packed + p * panel_bytes;
        const float *ps = pscale + p * wgroups * QP;
        const float *po = bits == 4 ? poffset + p * wgroups * QP : NULL;
        const int64_t col = p * QP;
#if HAVE_VNNI
        if (vnni) {
            if (bits == 8)
                panel_vnni8(rows, xq, xsum, xs, k, gs, per, panel, ps, po, bias, col, n, y, ybf);
            else
                panel_vnni4(rows, xq, xsum, xs, k, gs, per, panel, ps, po, bias, col, n, y, ybf);
            continue;
        }
#endif
        tile_plain(rows, 0, xq, xsum, xs, k, gs, per, bits, panel, ps, po, bias, col, n, y, ybf);
    }
    free(xq), free(xs), free(xsum);
    return 0;
}
