/* CPU kernels for fp32 and bf16 inference: paged decode attention and the fused element-wise ops of a
 * decoder layer. On a CPU these ops are bound by memory traffic and by per-op dispatch, not by arithmetic: torch
 * runs an RMSNorm as five passes over the activations and a decode attention as a gather, a copy and
 * SDPA. Each function here makes one pass, reads K/V in place through the block tables, and parallelises
 * with OpenMP. Loaded after torch, the library binds to torch's own OpenMP runtime (the same libgomp.so.1),
 * so it shares torch's thread pool instead of adding threads to it.
 *
 * Plain C99 (no torch headers: it builds in about a second); written so that GCC vectorises the inner
 * loops for whatever -march=native offers. Every kernel takes fp32 or bf16 tensors (a flag, `bf`): bf16
 * values are widened to fp32 on load, all arithmetic and accumulation is fp32, and results are rounded to
 * nearest-even bf16 on store. Each kernel body is one always-inlined function with the flag a constant, so
 * the compiler emits a separate loop for each dtype. On CPUs with AVX512_BF16 (the library is built with
 * -march=native for the CPU it runs on, keyed by its flags) the q.K dot products of bf16 attention use
 * vdpbf16ps and the stores vcvtneps2bf16; elsewhere plain AVX-512 / AVX2 shifts do the same. Layouts:
 *   KV pool of one layer: K [num_blocks, block_size, num_kv_heads, head_dim], V the same.
 *   q / k / v rows: token-major with a row stride (they are views into the fused qkv projection). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define PAR_MIN_WORK 32768 /* below this many floats an op runs on one thread: waking the pool costs more */

/* Explicit 16-float vectors (GCC/Clang vector extensions): the compiler maps them onto AVX-512, AVX2 or
 * SSE registers. GCC does not vectorise a scalar exp written with a float/int bit cast, so exp is written
 * on vectors directly. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint16_t bf16;
#define VW 16
#define ALWAYS static inline __attribute__((always_inline))

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* bf16 <-> fp32: a bf16 is the top half of an fp32, so widening is a shift; narrowing rounds to nearest
 * even (NaNs are not special-cased: the models' activations are finite). */
static inline vf vload_bf16(const bf16 *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline void vstore_bf16(bf16 *p, vf v) {
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

/* Element i of an fp32 (bf = 0) or bf16 (bf = 1) array, as fp32; and the 16 elements from i. */
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
/* x rounded to the storage dtype (what torch's op would have stored between two ops). */
ALWAYS vf rnd(vf v, const int bf) {
    if (!bf) return v;
    const vu u = (vu)v;
    return (vf)(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16);
}
ALWAYS float rnd1(float x, const int bf) { return bf ? round_bf16(x) : x; }
static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
static inline float hsum(vf v) {
#if defined(__clang__) || __GNUC__ >= 12 /* __builtin_shufflevector: a log-depth tree of lane swaps */
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    return v[0];
#else
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
#endif
}

#if defined(__clang__) || __GNUC__ >= 12
#define HAVE_SHUFFLE 1
/* sums16(a)[j] = hsum(a[j]) for 16 vectors: a tree of 15 shuffle-and-add pairs instead of 16 separate
 * horizontal sums (64 shuffles and adds), the cost that dominates a decode dot product of 64 dims. Each
 * level halves the partial sums per token and doubles the tokens per vector, in order. */
static inline vf sums16(vf *a) {
    vf r1[8], r2[4], r3[2];
    for (int i = 0; i < 8; i++)
        r1[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
              + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                        30, 31);
    for (int i = 0; i < 4; i++)
        r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                        27)
              + __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                        31);
    for (int i = 0; i < 2; i++)
        r3[i] = __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                        29)
              + __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                        31);
    return __builtin_shufflevector(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
#define HAVE_SHUFFLE 0
#endif

/* exp(x), within 2 ulp of expf for x in [-87, 88] (Cephes' single-precision method: range reduction by
 * ln 2 and a degree-6 polynomial); x is clamped to that range, so exp(-inf) gives ~1e-38, not 0. */
static inline vf exp_v(vf x) {
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

/* exp of up to VW floats (a loop tail): padded through a vector. */
static inline void exp_tail(const float *x, float *out, int64_t k, float shift) {
    float buf[VW] = {0};
    memcpy(buf, x, sizeof(float) * k);
    const vf e = exp_v(vload(buf) - shift);
    memcpy(buf, &e, sizeof buf);
    memcpy(out, buf, sizeof(float) * k);
}

/* ---- paged decode attention ------------------------------------------------------------------------- */

/* x[t] = exp(x[t] - max x) in place; returns the sum. */
static float exp_shifted(float *x, int64_t n) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) m = x[t] > m ? x[t] : m;
    vf acc = {0};
    int64_t t = 0;
    for (; t + VW <= n; t += VW) {
        const vf e = exp_v(vload(x + t) - m);
        vstore(x + t, e);
        acc += e;
    }
    if (t < n) exp_tail(x + t, x + t, n - t, m);
    for (; t < n; t++) sum += x[t];
    return sum + hsum(acc);
}

ALWAYS const void *at(const void *p, int64_t i, const int bf) { return (const char *)p + i * (bf ? 2 : 4); }

/* scores[t] = exp(scale q.K[t] - max) for the n cached tokens, returns their sum. The tokens' dot products
 * are independent, so the out-of-order core overlaps them; q stays in registers (as fp32, or for bf16 on
 * AVX512_BF16 as bf16 pairs for vdpbf16ps, whose products are exact and whose sums are fp32), and the
 * horizontal sums of 16 tokens are taken together (sums16). */
ALWAYS float head_scores(const void *qj, const void *k, const int32_t *table, int64_t n, float *sc, int64_t row,
                         const int64_t d, int64_t bs, float scale, const int bf) {
#if HAVE_SHUFFLE
    /* 16 tokens at a time: their dot products as 16 vectors of partial sums, reduced together */
    if (d % VW == 0 && d <= 16 * VW) {
#if HAVE_DPBF16
        __m512bh qb[8];
        const int use_dp = bf && d % 32 == 0 && d <= 8 * 32;
        if (use_dp)
            for (int64_t c = 0; c < d / 32; c++) memcpy(&qb[c], (const bf16 *)qj + c * 32, 64);
#else
        const int use_dp = 0;
#endif
        vf qv[16];
        if (!use_dp)
            for (int64_t c = 0; c < d / VW; c++) qv[c] = ldv(qj, c * VW, bf);
        for (int64_t t0 = 0; t0 < n; t0 += VW) {
            const int64_t m = n - t0 < VW ? n - t0 : VW;
            vf a[VW];
            for (int64_t j = 0; j < m; j++) {
                const int64_t t = t0 + j;
                const void *kt = at(k, ((int64_t)table[t / bs] * bs + t % bs) * row, bf);
#if HAVE_DPBF16
                if (use_dp) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t c = 0; c < d / 32; c++) {
                        __m512bh kv;
                        memcpy(&kv, (const bf16 *)kt + c * 32, 64);
                        acc = _mm512_dpbf16_ps(acc, qb[c], kv);
                    }
                    a[j] = (vf)acc;
                    continue;
                }
#endif
                vf acc = qv[0] * ldv(kt, 0, bf);
                for (int64_t c = 1; c < d / VW; c++) acc += qv[c] * ldv(kt, c * VW, bf);
                a[j] = acc;
            }
            for (int64_t j = m; j < VW; j++) a[j] = (vf){0};
            const vf dots = sums16(a) * scale;
            if (m == VW)
                vstore(sc + t0, dots);
            else
                memcpy(sc + t0, &dots, sizeof(float) * m);
        }
        return exp_shifted(sc, n);
    }
#endif
    if (d % VW == 0 && d <= 16 * VW) {
        vf qv[16];
        for (int64_t c = 0; c < d / VW; c++) qv[c] = ldv(qj, c * VW, bf);
        for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
            const void *kb = at(k, (int64_t)table[b] * bs * row, bf);
            const int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t t = 0; t < tn; t++) {
                const void *kt = at(kb, t * row, bf);
                vf a = qv[0] * ldv(kt, 0, bf);
                for (int64_t c = 1; c < d / VW; c++) a += qv[c] * ldv(kt, c * VW, bf);
                sc[t0 + t] = hsum(a) * scale;
            }
        }
    } else {
        for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
            const void *kb = at(k, (int64_t)table[b] * bs * row, bf);
            const int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t t = 0; t < tn; t++) {
                const void *kt = at(kb, t * row, bf);
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += ld1(qj, i, bf) * ld1(kt, i, bf);
                sc[t0 + t] = dot * scale;
            }
        }
    }
    return exp_shifted(sc, n);
}

/* o = (sum_t p[t] V[t]) / sum: the accumulator stays in registers, in fp32. */
ALWAYS void head_output(const float *p, float sum, const void *v, const int32_t *table, int64_t n, void *o,
                        int64_t row, const int64_t d, int64_t bs, const int bf) {
    const float inv = 1.0f / sum;
    if (d % VW == 0 && d <= 16 * VW) {
        vf acc[16];
        for (int64_t c = 0; c < d / VW; c++) acc[c] = (vf){0};
        for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
            const void *vb = at(v, (int64_t)table[b] * bs * row, bf);
            const int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t t = 0; t < tn; t++) {
                const float w = p[t0 + t];
                const void *vt = at(vb, t * row, bf);
                for (int64_t c = 0; c < d / VW; c++) acc[c] += w * ldv(vt, c * VW, bf);
            }
        }
        for (int64_t c = 0; c < d / VW; c++) stv(o, c * VW, acc[c] * inv, bf);
        return;
    }
    float acc[1024]; /* head_dim <= 1024 (checked by the caller) */
    for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
        const void *vb = at(v, (int64_t)table[b] * bs * row, bf);
        const int64_t tn = n - t0 < bs ? n - t0 : bs;
        for (int64_t t = 0; t < tn; t++) {
            const float w = p[t0 + t];
            const void *vt = at(vb, t * row, bf);
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] += w * ld1(vt, i, bf);
        }
    }
    for (int64_t i = 0; i < d; i++) st1(o, i, acc[i] * inv, bf);
}

ALWAYS void attend(const void *qj, const void *k, const void *v, const int32_t *table, int64_t n, float *sc,
                   void *oj, int64_t row, const int64_t d, int64_t bs, float scale, const int bf) {
    const float sum = head_scores(qj, k, table, n, sc, row, d, bs, scale, bf);
    head_output(sc, sum, v, table, n, oj, row, d, bs, bf);
}

ALWAYS int paged_decode_impl(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                             int64_t bt_stride, const int32_t *lens, void *out, int64_t max_len, int64_t num_seqs,
                             int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, const int bf) {
    const int64_t g = hq / hkv, row = hkv * d;
    int failed = d > 1024;
#pragma omp parallel reduction(| : failed)
    {
        float *sc = malloc(sizeof(float) * max_len);  /* one per thread, reused by its tasks */
        failed = sc == NULL || d > 1024;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t h = 0; h < hkv; h++) {
                if (failed) continue;
                const void *kh = at(k, h * d, bf), *vh = at(v, h * d, bf);
                const int32_t *table = bt + s * bt_stride;
                for (int64_t j = h * g; j < (h + 1) * g; j++) {
                    const void *qj = at(q, s * q_stride + j * d, bf);
                    void *oj = (void *)at(out, (s * hq + j) * d, bf);
                    if (d == 64)
                        attend(qj, kh, vh, table, lens[s], sc, oj, row, 64, bs, scale, bf);
                    else if (d == 128)
                        attend(qj, kh, vh, table, lens[s], sc, oj, row, 128, bs, scale, bf);
                    else
                        attend(qj, kh, vh, table, lens[s], sc, oj, row, d, bs, scale, bf);
                }
            }
        }
        free(sc);
    }
    return failed;
}

/* out[s, hq, d] = softmax(scale * q[s] K_s^T) V_s for every sequence s, one query token each.
 * q rows are q_stride elements apart; lens[s] in [1, max_len]; q, K/V and out are fp32, or bf16 when bf.
 * Returns 0, or 1 if a thread could not allocate its max_len-float score buffer (out is then incomplete)
 * or head_dim exceeds 1024.
 * A task is one (sequence, kv head): the query heads of its GQA group run one after another, so the
 * first brings the K/V rows into this core's cache and the others read them from there. */
int paged_decode(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                 int64_t bt_stride, const int32_t *lens, void *out, int64_t max_len, int64_t num_seqs,
                 int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf) {
    if (bf)
        return paged_decode_impl(q, q_stride, k, v, bt, bt_stride, lens, out, max_len, num_seqs, hq, hkv, d, bs,
                                 scale, 1);
    return paged_decode_impl(q, q_stride, k, v, bt, bt_stride, lens, out, max_len, num_seqs, hq, hkv, d, bs,
                             scale, 0);
}

/* ---- KV store --------------------------------------------------------------------------------------- */

/* Copy each token's K and V rows (width elements of elsize bytes, rows `stride` elements apart) into pool
 * slot slots[i]; a negative slot is padding and is skipped. */
void store_kv(const void *k, const void *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
              int64_t width, void *kc, void *vc, int64_t elsize) {
    const int64_t row = width * elsize, step = stride * elsize;
#pragma omp parallel for if (num_tokens * width > PAR_MIN_WORK)
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        memcpy((char *)kc + slots[i] * row, (const char *)k + i * step, row);
        memcpy((char *)vc + slots[i] * row, (const char *)v + i * step, row);
    }
}

/* ---- element-wise ops of a decoder layer ------------------------------------------------------------ */

/* out = weight * rmsnorm(h), with h = x + residual written back to residual when add is set (the
 * residual stream of the next op), else h = x. Rows of `dim` contiguous elements. In bf16 the
 * intermediate roundings are torch's (and transformers'): h is stored in bf16 and the norm is taken of
 * the stored h, the normalised row is rounded to bf16 before the weight multiplies it. */
ALWAYS void rms_norm_impl(const void *x, void *residual, const void *weight, void *out, int64_t rows,
                          int64_t dim, float eps, int add, const int bf) {
#pragma omp parallel for if (rows * dim > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const void *xr = at(x, r * dim, bf);
        void *hr = add ? (void *)at(residual, r * dim, bf) : (void *)xr, *orow = (void *)at(out, r * dim, bf);
        float ss = 0.0f;
        int64_t i = 0;
        vf acc = {0};
        if (add) {
            for (; i + VW <= dim; i += VW) {
                const vf h = rnd(ldv(hr, i, bf) + ldv(xr, i, bf), bf);
                stv(hr, i, h, bf);
                acc += h * h;
            }
            for (; i < dim; i++) {
                const float h = rnd1(ld1(hr, i, bf) + ld1(xr, i, bf), bf);
                st1(hr, i, h, bf);
                ss += h * h;
            }
        } else {
            for (; i + VW <= dim; i += VW) {
                const vf h = ldv(hr, i, bf);
                acc += h * h;
            }
            for (; i < dim; i++) ss += ld1(hr, i, bf) * ld1(hr, i, bf);
        }
        ss += hsum(acc);
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (i = 0; i + VW <= dim; i += VW) stv(orow, i, ldv(weight, i, bf) * rnd(ldv(hr, i, bf) * inv, bf), bf);
        for (; i < dim; i++) st1(orow, i, ld1(weight, i, bf) * rnd1(ld1(hr, i, bf) * inv, bf), bf);
    }
}

void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps,
              int add, int bf) {
    if (bf)
        rms_norm_impl(x, residual, weight, out, rows, dim, eps, add, 1);
    else
        rms_norm_impl(x, residual, weight, out, rows, dim, eps, add, 0);
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the gate and up halves of the fused projection. In bf16,
 * silu's result is rounded before the product, as torch's two ops do. */
ALWAYS void silu_mul_impl(const void *gu, void *out, int64_t rows, int64_t inter, const int bf) {
#pragma omp parallel for if (rows * inter > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const void *g = at(gu, r * 2 * inter, bf), *u = at(g, inter, bf);
        void *o = (void *)at(out, r * inter, bf);
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) {
            const vf x = ldv(g, i, bf);
            stv(o, i, rnd(x / (1.0f + exp_v(-x)), bf) * ldv(u, i, bf), bf);
        }
        if (i < inter) {
            float neg[VW], e[VW];
            for (int64_t j = 0; i + j < inter; j++) neg[j] = -ld1(g, i + j, bf);
            exp_tail(neg, e, inter - i, 0.0f);
            for (int64_t j = 0; i + j < inter; j++)
                st1(o, i + j, rnd1(ld1(g, i + j, bf) / (1.0f + e[j]), bf) * ld1(u, i + j, bf), bf);
        }
    }
}

void silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf) {
    if (bf)
        silu_mul_impl(gu, out, rows, inter, 1);
    else
        silu_mul_impl(gu, out, rows, inter, 0);
}

/* Rotary embedding in place on the first `heads` heads of each row (the q and k heads of the fused qkv
 * projection): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves of each head, with the
 * cos/sin rows of the token's position (fp32 tables [max_pos, d], both halves equal, as transformers
 * builds). Rows are `stride` elements apart; in bf16 the rotation is computed in fp32 and rounded once. */
ALWAYS void rope_impl(void *x, int64_t stride, int64_t rows, int64_t heads, int64_t d, const int64_t *positions,
                      const float *cos_t, const float *sin_t, const int bf) {
    const int64_t half = d / 2;
#pragma omp parallel for if (rows * heads * d > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + positions[r] * d, *s = sin_t + positions[r] * d;
        for (int64_t h = 0; h < heads; h++) {
            void *x1 = (void *)at(x, r * stride + h * d, bf), *x2 = (void *)at(x1, half, bf);
            int64_t i = 0;
            for (; i + VW <= half; i += VW) {
                const vf a = ldv(x1, i, bf), b = ldv(x2, i, bf);
                stv(x1, i, a * vload(c + i) - b * vload(s + i), bf);
                stv(x2, i, b * vload(c + half + i) + a * vload(s + half + i), bf);
            }
            for (; i < half; i++) {
                const float a = ld1(x1, i, bf), b = ld1(x2, i, bf);
                st1(x1, i, a * c[i] - b * s[i], bf);
                st1(x2, i, b * c[half + i] + a * s[half + i], bf);
            }
        }
    }
}

void rope(void *x, int64_t stride, int64_t rows, int64_t heads, int64_t d, const int64_t *positions,
          const float *cos_t, const float *sin_t, int bf) {
    if (bf)
        rope_impl(x, stride, rows, heads, d, positions, cos_t, sin_t, 1);
    else
        rope_impl(x, stride, rows, heads, d, positions, cos_t, sin_t, 0);
}

/* ---- bf16 logits ------------------------------------------------------------------------------------ */

/* out[r, :] = the bf16 logits of row r widened to fp32, and top[r, 0..k) the indices of its k largest (in
 * no order; ties keep the earlier index), in the one pass the widening makes anyway. A candidate has to
 * beat the smallest of the k kept, which after the first few hundred entries almost none does: the common
 * case is one vector compare per 16 logits. */
void logits_top(const bf16 *in, float *out, int64_t rows, int64_t vocab, int64_t k, int64_t *top) {
#pragma omp parallel for if (rows * vocab > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *x = in + r * vocab;
        float *o = out + r * vocab, val[64];
        int64_t *idx = top + r * k, kk = k < vocab ? k : vocab, lo = 0;
        for (int64_t j = 0; j < kk; j++) {
            val[j] = o[j] = bf16_to_f(x[j]);
            idx[j] = j;
        }
        for (int64_t j = 1; j < kk; j++) lo = val[j] < val[lo] ? j : lo;
        int64_t i = kk;
        for (; i < vocab; i++) { /* up to a multiple of VW */
            if (i % VW == 0) break;
            const float v = o[i] = bf16_to_f(x[i]);
            if (v > val[lo]) {
                val[lo] = v, idx[lo] = i;
                for (int64_t j = 0; j < kk; j++) lo = val[j] < val[lo] ? j : lo;
            }
        }
        for (; i + VW <= vocab; i += VW) {
            const vf v = vload_bf16(x + i);
            vstore(o + i, v);
            const vi beats = v > vsplat(val[lo]);
            int any = 0;
            for (int j = 0; j < VW; j++) any |= beats[j];
            if (!any) continue;
            for (int64_t t = i; t < i + VW; t++) {
                if (o[t] > val[lo]) {
                    val[lo] = o[t], idx[lo] = t;
                    for (int64_t j = 0; j < kk; j++) lo = val[j] < val[lo] ? j : lo;
                }
            }
        }
        for (; i < vocab; i++) {
            const float v = o[i] = bf16_to_f(x[i]);
            if (v > val[lo]) {
                val[lo] = v, idx[lo] = i;
                for (int64_t j = 0; j < kk; j++) lo = val[j] < val[lo] ? j : lo;
            }
        }
        for (int64_t j = kk; j < k; j++) idx[j] = idx[0]; /* vocab < k: repeat a kept index */
    }
}

/* ---- structured outputs' token mask ----------------------------------------------------------------- */

/* logits[r, t] = -inf where bit t % 32 of bitmask[r, t / 32] is 0, for each row r in rows and t < vocab
 * (fp32 logits, rows `stride` floats apart; bitmask rows `words` int32 apart, xgrammar's layout). The same
 * result as xgrammar's CPU kernel, which tests one bit per token: here one 32-bit word covers two vectors,
 * and a word with every bit set (most of a JSON grammar's allowed tokens) is skipped. */
void apply_token_bitmask(float *logits, int64_t stride, const int32_t *bitmask, int64_t words, const int64_t *rows,
                         int64_t num_rows, int64_t vocab) {
    const vf neg_inf = vsplat(-INFINITY);
    vu lane;
    for (int j = 0; j < VW; j++) lane[j] = (uint32_t)j;
#pragma omp parallel for if (num_rows * vocab > 16 * PAR_MIN_WORK)
    for (int64_t i = 0; i < num_rows; i++) {
        float *x = logits + rows[i] * stride;
        const uint32_t *m = (const uint32_t *)bitmask + rows[i] * words;
        int64_t t = 0;
        for (; t + 32 <= vocab; t += 32) {
            const uint32_t bits = m[t / 32];
            if (bits == 0xffffffffu) continue;
            for (int h = 0; h < 2; h++) {
                const vi off = (vi)((((vu){0} + (bits >> (16 * h))) >> lane) & 1u) == 0;
                vstore(x + t + 16 * h, vselect(off, neg_inf, vload(x + t + 16 * h)));
            }
        }
        for (; t < vocab; t++)
            if (!((m[t / 32] >> (t % 32)) & 1u)) x[t] = -INFINITY;
    }
}
