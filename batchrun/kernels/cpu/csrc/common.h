/* What the kernel families share: the CPU feature dispatch, vector types, fp32 / bf16 loads and stores, exp.
 * Each family includes it first; all are built into one library. Every kernel takes fp32 or bf16 (the flag `bf`):
 * bf16 is widened on load, computed and summed in fp32, and rounded to nearest even on store. A kernel body is an
 * always-inlined function with the flag a constant, so each dtype gets its own loop (BY_DTYPE in OpenMP regions). */
#ifndef BATCHRUN_COMMON_H
#define BATCHRUN_COMMON_H

#define _GNU_SOURCE /* syscall() (common.c) */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* AVX2 + FMA without AVX-512: the attention takes 8-float paths sized for 16 registers (chunk_scores8). */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_ATTENTION 1
#else
#define HAVE_AVX2_ATTENTION 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define HAVE_AMX 1
/* Whether this process may use AMX (common.c); first asked outside any parallel region. */
__attribute__((visibility("hidden"))) int amx_allowed(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tmm0-6, each 64 bytes wide: tmm0-3 of `rows` rows (the sums and the A tile of a linear's short call), tmm4-6 of
 * 16 (amx_panel, amx_attend_head). */
static inline void amx_configure_rows(int rows) {
    TileConfig c = {0};
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.rows[t] = t < 4 ? rows : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
static inline void amx_configure(void) { amx_configure_rows(16); }
#else
#define HAVE_AMX 0
#endif

#define PAR_MIN_WORK 32768 /* below this many floats an op runs on one thread: waking the pool costs more */

/* Vectors of VW floats, one register each (GCC does not vectorise a scalar exp written with bit casts). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef uint16_t vh __attribute__((vector_size(2 * VW)));
typedef uint16_t bf16;
#define ALWAYS static inline __attribute__((always_inline))

ALWAYS vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
ALWAYS void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* bf16 <-> fp32: widening is a shift; narrowing rounds to nearest even (NaNs not special-cased). */
ALWAYS vf vload_bf16(const bf16 *p) {
#if defined(__AVX512F__) /* one vpmovzxwd (GCC splits the generic conversion) */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}
ALWAYS void vstore_bf16(bf16 *p, vf v) {
#if HAVE_DPBF16
    __m256bh h = _mm512_cvtneps_pbh((__m512)v);
    memcpy(p, &h, sizeof h);
#else
    const vu u = (vu)v;
    const vh h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vh);
    memcpy(p, &h, sizeof h);
#endif
}
static inline float bf16_to_f(bf16 x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline bf16 f_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static inline float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }

/* Element i of an fp32 (bf = 0) or bf16 (bf = 1) array as fp32; ldv / stv: VW elements from i. */
ALWAYS float ld1(const void *p, int64_t i, const int bf) {
    return bf ? bf16_to_f(((const bf16 *)p)[i]) : ((const float *)p)[i];
}
ALWAYS void st1(void *p, int64_t i, float x, const int bf) {
    if (bf)
        ((bf16 *)p)[i] = f_to_bf16(x);
    else
        ((float *)p)[i] = x;
}
ALWAYS vf ldv(const void *p, int64_t i, const int bf) {
    return bf ? vload_bf16((const bf16 *)p + i) : vload((const float *)p + i);
}
ALWAYS void stv(void *p, int64_t i, vf v, const int bf) {
    if (bf)
        vstore_bf16((bf16 *)p + i, v);
    else
        vstore((float *)p + i, v);
}
/* x rounded to the storage dtype, as torch stores it between two ops. */
ALWAYS vf rnd(vf v, const int bf) {
    if (!bf) return v;
    const vu u = (vu)v;
    return (vf)(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16);
}
ALWAYS float rnd1(float x, const int bf) { return bf ? round_bf16(x) : x; }
ALWAYS vf vsplat(float x) { return (vf){0} + x; }
ALWAYS vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
/* Whether (v, i) ranks before (w, j) in a row of logits: the larger value, of equal ones the smaller id (the order
 * the top-k kernels keep, the first maximum first). */
ALWAYS int ranks_before(float v, int64_t i, float w, int64_t j) { return v > w || (v == w && i < j); }
/* The largest of x[0..n) (-inf where there is none), *any_nan whether one is NaN: a row's one pass before its
 * argmax or its draw. */
ALWAYS float row_max(const float *x, int64_t n, int *any_nan) {
    vf mv = vsplat(-INFINITY);
    vi nan = {0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf v = vload(x + i);
        mv = vselect(v > mv, v, mv);
        nan |= v != v;
    }
    float m = -INFINITY;
    *any_nan = 0;
    for (int j = 0; j < VW; j++) m = mv[j] > m ? mv[j] : m, *any_nan |= nan[j];
    for (; i < n; i++) m = x[i] > m ? x[i] : m, *any_nan |= x[i] != x[i];
    return m;
}
/* Whether a lane of v is above x or NaN (x not NaN): one compare into a mask, where a loop over the lanes of a
 * vector compare would not be folded into one. */
ALWAYS int any_above_or_nan(vf v, float x) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(x), _CMP_NLE_UQ) != 0;
#elif defined(__AVX__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(x), _CMP_NLE_UQ)) != 0;
#else
    const vi hit = ~(v <= vsplat(x));
    int any = 0;
    for (int j = 0; j < VW; j++) any |= hit[j];
    return any;
#endif
}
ALWAYS float hsum(vf v) {
#if (defined(__clang__) || __GNUC__ >= 12) && VW == 16 /* a log-depth tree of lane swaps */
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    return v[0];
#elif defined(__clang__) || __GNUC__ >= 12
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0);
    return v[0];
#else
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
#endif
}



/* exp(x) within 2 ulp of expf (Cephes: reduction by ln 2, a degree-6 polynomial); x is clamped to [-87, 88],
 * so exp(-inf) is ~1e-38, not 0. */
ALWAYS vf exp_v(vf x) {
    x = vselect(x < -87.0f, vsplat(-87.0f), x);
    x = vselect(x > 88.0f, vsplat(88.0f), x);
    const vf t = x * 1.44269504088896341f + 0.5f;
    vi ni = __builtin_convertvector(t, vi);  /* truncates: step down where that rounded up */
    vf n = __builtin_convertvector(ni, vf);
    const vi up = n > t;
    ni += up;
    n += __builtin_convertvector(up, vf);
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((ni + 127) << 23);
}

/* exp((x - shift) * scale) of k <= VW floats (a loop tail), through a padded vector. */
static inline void exp_tail(const float *x, float *out, int64_t k, float shift, float scale) {
    float buf[VW] = {0};
    memcpy(buf, x, sizeof(float) * k);
    const vf e = exp_v((vload(buf) - shift) * scale);
    memcpy(buf, &e, sizeof buf);
    memcpy(out, buf, sizeof(float) * k);
}

/* Element i of an fp32 (bf = 0) or bf16 (bf = 1) array, as an address. */
ALWAYS const void *at(const void *p, int64_t i, const int bf) { return (const char *)p + i * (bf ? 2 : 4); }

/* impl(args..., bf) with bf a literal: an OpenMP region is outlined before inlining, so inside one this makes
 * the dtype a constant again in each copy of the body. */
#define BY_DTYPE(bf, impl, ...) do { if (bf) impl(__VA_ARGS__, 1); else impl(__VA_ARGS__, 0); } while (0)

#if HAVE_AVX2_ATTENTION
/* 8 values from element i of p as fp32 (the AVX2 attention and linear panels). */
ALWAYS __m256 ld8(const void *p, int64_t i, const int bf) {
    if (bf)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
#endif

#endif /* BATCHRUN_COMMON_H */
