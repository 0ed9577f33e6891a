/* Weight-only quantized linears y = x W^T + bias on int8 / int4 weights (layouts/quant_weight.py), the activations
 * quantized on the fly per row and group of gs inputs (gs divides the weights' group wgs):
 *     y[r, o] = sum_g xs[r, g] ( scale[o, g] sum_{i in g} q[o, i] xq[r, i]  (+ offset[o, g] sum_{i in g} xq[r, i]) )
 * xq in -127..127, xs = max |x| / 127; inner sums exact in int32, the rest fp32 (docs/quantization.md).
 *
 * Layout (packed once): panels of QP = 32 outputs, zero past n. int8: packed[p][i / 4][j][i % 4] = q + 128, what
 * vpdpbusd multiplies; int4: packed[p][i / 8][j][i % 4], the low nibble input 8t + b, the high one 8t + 4 + b. Per
 * panel and weight group: QP fp32 scales (int4: and offsets). The VNNI, AVX2 and plain C kernels compute the same
 * integer and fp32 sums; the threads split the panels, the rows go in register tiles of QROWS. */
#include "common.h"

#define QP 32    /* outputs per panel */
#define QROWS 4  /* rows per register tile */
#define QPREFETCH 6144 /* bytes ahead of the panel's stream that a tile prefetches */
#define QBLOCK 64 /* rows that take a panel's weight groups together (a multiple of QROWS) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if !HAVE_VNNI && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_QUANT 1
#else
#define HAVE_AVX2_QUANT 0
#endif

/* The outputs per panel of the packed layout (the Python side sizes its buffers with it). */
int quant_linear_panel(void) { return QP; }
/* The vector kernel compiled in: 2 AVX512-VNNI, 1 AVX2, 0 none (the plain C loop). */
int quant_isa(void) { return HAVE_VNNI ? 2 : HAVE_AVX2_QUANT ? 1 : 0; }

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

/* The vector tiles read the quantized rows interleaved by tile, one sequential stream per tile: row r0 + r's 4
 * bytes of k-step t are at XTILE(xt, r0, k, t) + 4 r (r0 a multiple of QROWS). */
#define XTILE(xt, r0, k, t) ((xt) + (((r0) / QROWS) * ((k) / 4) + (t)) * (4 * QROWS))

/* Where row r's 4 bytes of k-step t go: interleaved by tile (tiled) or row after row. */
static inline uint8_t *xq_at(uint8_t *xq, int64_t r, int64_t k, int64_t t, const int tiled) {
    return tiled ? XTILE(xq, r / QROWS * QROWS, k, t) + 4 * (r % QROWS) : xq + r * k + 4 * t;
}

#if defined(__AVX2__) /* the vector paths of quantize_row */
/* The low `steps` k-steps (4 bytes each) of b, from input i of row r, to where xq_at puts them. */
ALWAYS void put_steps(uint8_t *xq, int64_t r, int64_t k, int64_t i, __m128i b, const int steps, const int tiled) {
    int32_t w[4];
    _mm_storeu_si128((__m128i *)w, b);
    for (int j = 0; j < steps; j++) memcpy(xq_at(xq, r, k, i / 4 + j, tiled), &w[j], 4);
}
#endif

/* Row r of x -> xq[r] (in the tiles' order where tiled), and per group of gs inputs its scale xs = max |x| / 127
 * and the sum of its xq (xsum). Rounding to nearest even, as torch.round. */
ALWAYS void quantize_row(const void *x, int64_t r, int64_t k, int64_t gs, uint8_t *xq, float *xs,
                         int32_t *xsum, const int tiled, const int bf) {
    const void *row = at(x, r * k, bf);
    for (int64_t g = 0; g < k / gs; g++) {
        const int64_t end = (g + 1) * gs;
        int64_t i = g * gs;
        vf mv = vsplat(0.0f);
        for (; i + VW <= end; i += VW) {
            const vf v = ldv(row, i, bf);
            const vf a = vselect(v < 0.0f, -v, v);
            mv = vselect(a > mv, a, mv);
        }
#if defined(__AVX512F__) && VW == 16
        float m = _mm512_reduce_max_ps((__m512)mv);
#else
        float m = 0.0f;
        for (int j = 0; j < VW; j++) m = fmaxf(m, mv[j]);
#endif
        for (; i < end; i++) m = fmaxf(m, fabsf(ld1(row, i, bf)));
        const float inv = m > 0.0f ? 127.0f / m : 0.0f;
        xs[r * (k / gs) + g] = m / 127.0f;
        int32_t s = 0;
        i = g * gs;
        /* |x * inv| <= 127 up to rounding: the clamp only catches that rounding */
#if defined(__AVX512F__) && VW == 16
        /* in vectors (the loop below does not vectorize): the conversion rounds to nearest even, as rintf */
        __m512i sv = _mm512_setzero_si512();
        for (; i + VW <= end; i += VW) {
            const vf v = ldv(row, i, bf) * inv;
            const __m512 c = _mm512_min_ps(_mm512_max_ps((__m512)v, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
            const __m512i qi = _mm512_cvtps_epi32(c);
            sv = _mm512_add_epi32(sv, qi);
            put_steps(xq, r, k, i, _mm512_cvtepi32_epi8(qi), 4, tiled);
        }
        s += _mm512_reduce_add_epi32(sv);
#elif defined(__AVX2__) && VW == 8
        /* the same in AVX2: each 128-bit lane's four low bytes gathered, then the two lanes side by side */
        const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                   0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i sv = _mm256_setzero_si256();
        for (; i + VW <= end; i += VW) {
            const vf v = ldv(row, i, bf) * inv;
            const __m256 c = _mm256_min_ps(_mm256_max_ps((__m256)v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
            const __m256i qi = _mm256_cvtps_epi32(c);
            sv = _mm256_add_epi32(sv, qi);
            const __m256i b = _mm256_shuffle_epi8(qi, low_bytes);
            put_steps(xq, r, k, i, _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)), 2,
                      tiled);
        }
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sv), _mm256_extracti128_si256(sv, 1));
        const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s += _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
#endif
        for (; i + VW <= end; i += VW) {
            const vf v = ldv(row, i, bf) * inv;
            vi qi;
            for (int j = 0; j < VW; j++) {
                const float c = v[j] > 127.0f ? 127.0f : v[j] < -127.0f ? -127.0f : v[j];
                qi[j] = (int32_t)rintf(c);
            }
            for (int j = 0; j < VW; j++) {
                s += qi[j];
                xq_at(xq, r, k, (i + j) / 4, tiled)[(i + j) % 4] = (uint8_t)(int8_t)qi[j];
            }
        }
        for (; i < end; i++) {
            float v = ld1(row, i, bf) * inv;
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            const int32_t qi = (int32_t)rintf(v);
            s += qi;
            xq_at(xq, r, k, i / 4, tiled)[i % 4] = (uint8_t)(int8_t)qi;
        }
        xsum[r * (k / gs) + g] = s;
    }
}

static void quantize_rows(const void *x, int64_t rows, int64_t k, int64_t gs, uint8_t *xq, float *xs, int32_t *xsum,
                          int tiled, int bf) {
#pragma omp parallel for if (rows * k > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        if (tiled)
            BY_DTYPE(bf, quantize_row, x, r, k, gs, xq, xs, xsum, 1);
        else
            BY_DTYPE(bf, quantize_row, x, r, k, gs, xq, xs, xsum, 0);
    }
}

/* One row's QP outputs from col plus the bias, stored in the output dtype; only `left` of them in the last panel. */
static void store_row(const float *acc, int64_t left, const void *bias, int64_t col, void *y, int ybf) {
    const int64_t m = left < QP ? left : QP;
    for (int64_t j = 0; j < m; j++) {
        float v = acc[j];
        if (bias != NULL) v += ld1(bias, col + j, ybf);
        st1(y, col + j, v, ybf);
    }
}

/* The fp32 side, the same in every kernel: per weight group wg, part[o] = sum_{g in wg} xs[r, g] * isum[o, g] in
 * order, then
 *     int8: acc[o] += scale[o, wg] * (part[o] - 128 * xw[r, wg])
 *     int4: acc[o] += scale[o, wg] * part[o] + offset[o, wg] * xw[r, wg]
 * with xw[r, wg] = sum_{g in wg} xs[r, g] * xsum[r, g] (weight_group_sums). */

/* The plain C kernel: rows [r0, r0 + rows) of one panel. */
static void tile_plain(int64_t rows, int64_t r0, const uint8_t *xq, const float *xw, const float *xs, int64_t k,
                       int64_t gs, int64_t per, int bits, const uint8_t *panel, const float *pscale,
                       const float *poffset, const void *bias, int64_t col, int64_t n, void *y, int ybf) {
    const int64_t groups = k / gs, wgroups = groups / per;
    for (int64_t r = r0; r < r0 + rows; r++) {
        const int8_t *xr = (const int8_t *)xq + r * k;
        float acc[QP] = {0};
        for (int64_t wg = 0; wg < wgroups; wg++) {
            float part[QP] = {0};
            for (int64_t g = wg * per; g < (wg + 1) * per; g++) {
                int32_t isum[QP] = {0};
                for (int64_t i = g * gs; i < (g + 1) * gs; i++) {
                    const int32_t xv = xr[i];
                    if (bits == 8) {
                        const uint8_t *w = panel + i / 4 * QP * 4 + i % 4;
                        for (int j = 0; j < QP; j++) isum[j] += xv * (int32_t)w[4 * j];
                    } else {
                        const uint8_t *w = panel + i / 8 * QP * 4 + i % 4;
                        const int shift = (i % 8) >= 4 ? 4 : 0;
                        for (int j = 0; j < QP; j++) isum[j] += xv * ((w[4 * j] >> shift) & 15);
                    }
                }
                const float xsg = xs[r * groups + g];
                for (int j = 0; j < QP; j++) part[j] = fmaf((float)isum[j], xsg, part[j]);
            }
            const float *s = pscale + wg * QP, xwg = xw[r * wgroups + wg];
            if (bits == 8) {
                for (int j = 0; j < QP; j++) acc[j] = fmaf(s[j], part[j] - 128.0f * xwg, acc[j]);
            } else {
                const float *off = poffset + wg * QP;
                for (int j = 0; j < QP; j++) acc[j] = fmaf(off[j], xwg, fmaf(s[j], part[j], acc[j]));
            }
        }
        store_row(acc, n - col, bias, col, (void *)at(y, r * n, ybf), ybf);
    }
}

/* GCC's loop-invariant motion made the int4 tile spill its unpacked weights; int4 is compiled without it. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_LOOP_MOTION __attribute__((optimize("no-tree-loop-im")))
#else
#define NO_LOOP_MOTION
#endif

#if HAVE_VNNI
/* acc += w (unsigned bytes) . x (signed bytes), four products per int32 lane; inline assembly, as GCC's code for
 * the intrinsic copied the accumulators and reloaded the weights. */
#define DPBUSD(acc, w, x) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))
/* The four weight vectors of a two-k-step kept in registers (GCC reloaded them for every row). */
#define IN_REGISTERS(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))

/* Two k-steps of 32 outputs for the tile's R rows from input `at`: (a0, a1) times each row's 4 activation bytes,
 * (b0, b1) times the next 4. For one or two rows the second step sums into js, halving the dependent chains. */
#define TWO_STEPS(at, a0, a1, b0, b1)                                             \
    for (int r = 0; r < R; r++) {                                                \
        int32_t xa, xb;                                                          \
        memcpy(&xa, XTILE(xt, r0, k, (at) / 4) + 4 * r, 4);                     \
        memcpy(&xb, XTILE(xt, r0, k, (at) / 4 + 1) + 4 * r, 4);                 \
        const __m512i ba = _mm512_set1_epi32(xa), bb = _mm512_set1_epi32(xb);    \
        DPBUSD(is[r][0], a0, ba);                                                \
        DPBUSD(is[r][1], a1, ba);                                                \
        if (R <= 2) {                                                            \
            DPBUSD(js[r % 2][0], b0, bb);                                        \
            DPBUSD(js[r % 2][1], b1, bb);                                        \
        } else {                                                                 \
            DPBUSD(is[r][0], b0, bb);                                            \
            DPBUSD(is[r][1], b1, bb);                                            \
        }                                                                        \
    }

/* AVX512-VNNI: weight group wg of one panel for R rows from r0, folded into acc (QP floats a row); the tile
 * prefetches its share of the panel's stream, a line from `fetch` per `fetch_every` bytes it reads. */
ALWAYS void tile_vnni(const int R, int64_t r0, int64_t wg, const uint8_t *xt, const float *xw, const float *xs,
                      const int32_t *xsum, int64_t k, int64_t gs, int64_t per, const int bits, const uint8_t *panel, const float *pscale,
                      const float *poffset, float *acc, const char *fetch, int64_t fetch_every) {
    const int64_t groups = k / gs, wgroups = groups / per;
    const __m512i low4 = _mm512_set1_epi8(15);
    (void)xsum; /* int8's bias comes off in fp32 (xw) */
    int64_t credit = 0;
    __m512 part[QROWS][2];
    for (int r = 0; r < R; r++) part[r][0] = part[r][1] = _mm512_setzero_ps();
    for (int64_t g = wg * per; g < (wg + 1) * per; g++) {
        /* before the group's sums are live: in the inner loop the bookkeeping made GCC spill */
        for (credit += gs * QP * bits / 8; credit >= fetch_every; fetch += 64, credit -= fetch_every)
            _mm_prefetch(fetch, _MM_HINT_T0);
        __m512i is[QROWS][2];
        for (int r = 0; r < R; r++) is[r][0] = is[r][1] = _mm512_setzero_si512();
        __m512i js[2][2]; /* one or two rows: the second k-step's sums (TWO_STEPS) */
        for (int r = 0; r < (R <= 2 ? R : 0); r++) js[r][0] = js[r][1] = _mm512_setzero_si512();
        if (bits == 8) {
            int64_t t = g * gs / 4;
            const int64_t te = (g + 1) * gs / 4;
            for (; t + 1 < te; t += 2) {  /* two k-steps at a time, as int4's byte holds two */
                const uint8_t *w = panel + t * 128;
                __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
                __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
                IN_REGISTERS(w0, w1, w2, w3);
                TWO_STEPS(4 * t, w0, w1, w2, w3);
            }
            for (; t < te; t++) {
                const uint8_t *w = panel + t * 128;
                const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
                for (int r = 0; r < R; r++) {
                    int32_t xv;
                    memcpy(&xv, XTILE(xt, r0, k, t) + 4 * r, 4);
                    const __m512i xb = _mm512_set1_epi32(xv);
                    DPBUSD(is[r][0], w0, xb);
                    DPBUSD(is[r][1], w1, xb);
                }
            }
        } else {
            for (int64_t t = g * gs / 8; t < (g + 1) * gs / 8; t++) {
                const uint8_t *w = panel + t * 128;
                const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 64);
                const __m512i lo0 = _mm512_and_si512(v0, low4), lo1 = _mm512_and_si512(v1, low4);
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);
                TWO_STEPS(8 * t, lo0, lo1, hi0, hi1);
            }
        }
        for (int r = 0; r < (R <= 2 ? R : 0); r++) {
            is[r][0] = _mm512_add_epi32(is[r][0], js[r % 2][0]);
            is[r][1] = _mm512_add_epi32(is[r][1], js[r % 2][1]);
        }
        for (int r = 0; r < R; r++) {
            const __m512 xsg = _mm512_set1_ps(xs[(r0 + r) * groups + g]);
            part[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][0]), xsg, part[r][0]);
            part[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][1]), xsg, part[r][1]);
        }
    }
    const float *sg = pscale + wg * QP;
    const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
    if (bits == 8) {
        for (int r = 0; r < R; r++) {
            float *a = acc + r * QP;
            const __m512 c = _mm512_set1_ps(128.0f * xw[(r0 + r) * wgroups + wg]);
            _mm512_storeu_ps(a, _mm512_fmadd_ps(s0, _mm512_sub_ps(part[r][0], c), _mm512_loadu_ps(a)));
            _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(s1, _mm512_sub_ps(part[r][1], c), _mm512_loadu_ps(a + 16)));
        }
    } else {
        const float *off = poffset + wg * QP;
        const __m512 o0 = _mm512_loadu_ps(off), o1 = _mm512_loadu_ps(off + 16);
        for (int r = 0; r < R; r++) {
            float *a = acc + r * QP;
            const __m512 c = _mm512_set1_ps(xw[(r0 + r) * wgroups + wg]);
            _mm512_storeu_ps(a, _mm512_fmadd_ps(o0, c, _mm512_fmadd_ps(s0, part[r][0], _mm512_loadu_ps(a))));
            _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(o1, c, _mm512_fmadd_ps(s1, part[r][1], _mm512_loadu_ps(a + 16))));
        }
    }
}

#define TILE tile_vnni
#elif HAVE_AVX2_QUANT
#define QH 8 /* outputs per pass of tile_avx2: one ymm of int32 sums per row */

/* AVX2: tile_vnni's work on vpmaddubsw, in passes of QH outputs (no spill), fp32 parts in L1 between groups.
 * int8: |q| (unsigned) times xq with q's sign (vpsignb): pair sums within 2 * 128 * 127, exact; adding 128 xsum
 * gives the plain loop's sums of (q + 128) xq. int4: pair sums within 2 * 15 * 127, so they add in 16 bits over up
 * to 32 inputs before widening. */
ALWAYS void tile_avx2(const int R, int64_t r0, int64_t wg, const uint8_t *xt, const float *xw, const float *xs,
                      const int32_t *xsum, int64_t k, int64_t gs, int64_t per, const int bits, const uint8_t *panel,
                      const float *pscale, const float *poffset, float *acc, const char *fetch, int64_t fetch_every) {
    const int64_t groups = k / gs, wgroups = groups / per;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80), low4 = _mm256_set1_epi8(15);
    int64_t credit = 0;
    float part[QROWS][QP];
    memset(part, 0, sizeof part);
    for (int64_t g = wg * per; g < (wg + 1) * per; g++) {
        for (credit += gs * QP * bits / 8; credit >= fetch_every; fetch += 64, credit -= fetch_every)
            _mm_prefetch(fetch, _MM_HINT_T0);
        for (int h = 0; h < QP; h += QH) {
            __m256i is[QROWS][QH / 8];
            for (int r = 0; r < R; r++)
                for (int v = 0; v < QH / 8; v++) is[r][v] = _mm256_setzero_si256();
            if (bits == 8) {
                for (int64_t t = g * gs / 4; t < (g + 1) * gs / 4; t++) {
                    const uint8_t *w = panel + t * 128 + h * 4;
                    __m256i q[QH / 8], a[QH / 8];
                    for (int v = 0; v < QH / 8; v++) {
                        q[v] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32 * v)), flip);
                        a[v] = _mm256_abs_epi8(q[v]);
                    }
                    for (int r = 0; r < R; r++) {
                        int32_t xv;
                        memcpy(&xv, XTILE(xt, r0, k, t) + 4 * r, 4);
                        const __m256i xb = _mm256_set1_epi32(xv);
                        for (int v = 0; v < QH / 8; v++) {
                            const __m256i pairs = _mm256_maddubs_epi16(a[v], _mm256_sign_epi8(xb, q[v]));
                            is[r][v] = _mm256_add_epi32(is[r][v], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
                for (int r = 0; r < R; r++) {
                    const __m256i c = _mm256_set1_epi32(128 * xsum[(r0 + r) * groups + g]);
                    for (int v = 0; v < QH / 8; v++) is[r][v] = _mm256_add_epi32(is[r][v], c);
                }
            } else {
                const int64_t te = (g + 1) * gs / 8;
                for (int64_t t = g * gs / 8; t < te;) {
                    const int64_t tc = te - t > 4 ? t + 4 : te; /* 16-bit sums over at most 32 inputs */
                    __m256i ps[QROWS][QH / 8];
                    for (int r = 0; r < R; r++)
                        for (int v = 0; v < QH / 8; v++) ps[r][v] = _mm256_setzero_si256();
                    for (; t < tc; t++) {
                        const uint8_t *w = panel + t * 128 + h * 4;
                        __m256i lo[QH / 8], hi[QH / 8];
                        for (int v = 0; v < QH / 8; v++) {
                            const __m256i b = _mm256_loadu_si256((const __m256i *)(w + 32 * v));
                            lo[v] = _mm256_and_si256(b, low4);
                            hi[v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
                        }
                        for (int r = 0; r < R; r++) {
                            int32_t xa, xb;
                            memcpy(&xa, XTILE(xt, r0, k, 2 * t) + 4 * r, 4);
                            memcpy(&xb, XTILE(xt, r0, k, 2 * t + 1) + 4 * r, 4);
                            const __m256i ba = _mm256_set1_epi32(xa), bb = _mm256_set1_epi32(xb);
                            for (int v = 0; v < QH / 8; v++) {
                                const __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], ba),
                                                                     _mm256_maddubs_epi16(hi[v], bb));
                                ps[r][v] = _mm256_add_epi16(ps[r][v], two);
                            }
                        }
                    }
                    for (int r = 0; r < R; r++)
                        for (int v = 0; v < QH / 8; v++)
                            is[r][v] = _mm256_add_epi32(is[r][v], _mm256_madd_epi16(ps[r][v], ones));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256 xsg = _mm256_set1_ps(xs[(r0 + r) * groups + g]);
                for (int v = 0; v < QH / 8; v++) {
                    float *pp = part[r] + h + 8 * v;
                    _mm256_storeu_ps(pp, _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r][v]), xsg, _mm256_loadu_ps(pp)));
                }
            }
        }
    }
    for (int v = 0; v < QP / 8; v++) {
        const __m256 s = _mm256_loadu_ps(pscale + wg * QP + 8 * v);
        if (bits == 8) {
            for (int r = 0; r < R; r++) {
                float *a = acc + r * QP + 8 * v;
                const __m256 c = _mm256_set1_ps(128.0f * xw[(r0 + r) * wgroups + wg]);
                _mm256_storeu_ps(a, _mm256_fmadd_ps(s, _mm256_sub_ps(_mm256_loadu_ps(part[r] + 8 * v), c),
                                                    _mm256_loadu_ps(a)));
            }
        } else {
            const __m256 o = _mm256_loadu_ps(poffset + wg * QP + 8 * v);
            for (int r = 0; r < R; r++) {
                float *a = acc + r * QP + 8 * v;
                const __m256 c = _mm256_set1_ps(xw[(r0 + r) * wgroups + wg]);
                _mm256_storeu_ps(a, _mm256_fmadd_ps(o, c, _mm256_fmadd_ps(s, _mm256_loadu_ps(part[r] + 8 * v),
                                                                         _mm256_loadu_ps(a))));
            }
        }
    }
}
#define TILE tile_avx2
#endif

#if HAVE_VNNI || HAVE_AVX2_QUANT
/* One panel: rows in blocks of QBLOCK, weight group by weight group, every tile taking the group while it is in
 * cache (the panel streams once per block); the prefetch QPREFETCH ahead is shared out over the block's tiles. */
ALWAYS void panel_simd(int64_t rows, const uint8_t *xt, const float *xw, const float *xs, const int32_t *xsum,
                       int64_t k, int64_t gs, int64_t per, const int bits, const uint8_t *panel, const float *pscale,
                       const float *poffset, const void *bias, int64_t col, int64_t n, void *y, int ybf) {
    const int64_t wgroups = k / gs / per, group_bytes = gs * per * QP * bits / 8;
    float acc[QBLOCK * QP];
    for (int64_t b0 = 0; b0 < rows; b0 += QBLOCK) {
        const int64_t brows = rows - b0 < QBLOCK ? rows - b0 : QBLOCK, tiles = (brows + QROWS - 1) / QROWS;
        memset(acc, 0, sizeof(float) * (size_t)(brows * QP));
        for (int64_t wg = 0; wg < wgroups; wg++) {
            const char *ahead = (const char *)panel + wg * group_bytes + QPREFETCH;
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t r = t * QROWS;
                const char *fetch = ahead + t * group_bytes / tiles / 64 * 64;
                switch (brows - r < QROWS ? brows - r : QROWS) {
                case 4: TILE(4, b0 + r, wg, xt, xw, xs, xsum, k, gs, per, bits, panel, pscale, poffset, acc + r * QP, fetch, 64 * tiles); break;
                case 3: TILE(3, b0 + r, wg, xt, xw, xs, xsum, k, gs, per, bits, panel, pscale, poffset, acc + r * QP, fetch, 64 * tiles); break;
                case 2: TILE(2, b0 + r, wg, xt, xw, xs, xsum, k, gs, per, bits, panel, pscale, poffset, acc + r * QP, fetch, 64 * tiles); break;
                default: TILE(1, b0 + r, wg, xt, xw, xs, xsum, k, gs, per, bits, panel, pscale, poffset, acc + r * QP, fetch, 64 * tiles); break;
                }
            }
        }
        for (int64_t r = 0; r < brows; r++) store_row(acc + r * QP, n - col, bias, col, (void *)at(y, (b0 + r) * n, ybf), ybf);
    }
}
static void panel_simd8(int64_t rows, const uint8_t *xt, const float *xw, const float *xs, const int32_t *xsum,
                        int64_t k, int64_t gs, int64_t per, const uint8_t *panel, const float *pscale,
                        const float *poffset, const void *bias, int64_t col, int64_t n, void *y, int ybf) {
    panel_simd(rows, xt, xw, xs, xsum, k, gs, per, 8, panel, pscale, poffset, bias, col, n, y, ybf);
}
NO_LOOP_MOTION static void panel_simd4(int64_t rows, const uint8_t *xt, const float *xw, const float *xs,
                                       const int32_t *xsum, int64_t k, int64_t gs, int64_t per, const uint8_t *panel,
                                       const float *pscale, const float *poffset, const void *bias, int64_t col,
                                       int64_t n, void *y, int ybf) {
    panel_simd(rows, xt, xw, xs, xsum, k, gs, per, 4, panel, pscale, poffset, bias, col, n, y, ybf);
}
#endif

/* xw[r, wg] = sum_{g in wg} xs[r, g] * xsum[r, g] in order: what int8's bias and int4's offsets multiply. */
static void weight_group_sums(int64_t rows, int64_t groups, int64_t per, const float *xs, const int32_t *xsum,
                              float *xw) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t wg = 0; wg < groups / per; wg++) {
            float s = 0.0f;
            for (int64_t g = wg * per; g < (wg + 1) * per; g++) s = fmaf(xs[r * groups + g], (float)xsum[r * groups + g], s);
            xw[r * (groups / per) + wg] = s;
        }
}

/* y [rows, n] (ybf: bf16) = x [rows, k] (xbf: bf16) times the packed weight (weight groups of wgs) plus bias, the
 * activations in groups of gs; plain: the C loop. k and gs in whole k-steps; 1 without scratch memory. */
int quant_linear(const void *x, int64_t rows, int64_t k, int xbf, const uint8_t *packed, const float *pscale,
                 const float *poffset, int64_t n, int64_t wgs, int64_t gs, int bits, const void *bias, void *y, int ybf,
                 int plain) {
    if (rows <= 0) return 0;
    const int simd = (HAVE_VNNI || HAVE_AVX2_QUANT) && !plain;
    const int64_t groups = k / gs, wgroups = k / wgs, per = wgs / gs, panels = (n + QP - 1) / QP;
    const int64_t panel_bytes = bits == 8 ? k * QP : k / 2 * QP;
    /* in the tiles' order (XTILE), the last tile padded to QROWS rows */
    uint8_t *xq = malloc((size_t)((simd ? (rows + QROWS - 1) / QROWS * QROWS : rows) * k));
    float *xs = malloc(sizeof(float) * (size_t)(rows * groups));
    int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(rows * groups));
    float *xw = malloc(sizeof(float) * (size_t)(rows * wgroups));
    if (xq == NULL || xs == NULL || xsum == NULL || xw == NULL) {
        free(xq), free(xs), free(xsum), free(xw);
        return 1;
    }
    quantize_rows(x, rows, k, gs, xq, xs, xsum, simd, xbf);
    weight_group_sums(rows, groups, per, xs, xsum, xw);
#pragma omp parallel for schedule(static) if (rows * n * k > PAR_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *panel = packed + p * panel_bytes;
        const float *ps = pscale + p * wgroups * QP;
        const float *po = bits == 4 ? poffset + p * wgroups * QP : NULL;
        const int64_t col = p * QP;
#if HAVE_VNNI || HAVE_AVX2_QUANT
        if (simd) {
            if (bits == 8)
                panel_simd8(rows, xq, xw, xs, xsum, k, gs, per, panel, ps, po, bias, col, n, y, ybf);
            else
                panel_simd4(rows, xq, xw, xs, xsum, k, gs, per, panel, ps, po, bias, col, n, y, ybf);
            continue;
        }
#endif
        tile_plain(rows, 0, xq, xw, xs, k, gs, per, bits, panel, ps, po, bias, col, n, y, ybf);
    }
    free(xq), free(xs), free(xsum), free(xw);
    return 0;
}
