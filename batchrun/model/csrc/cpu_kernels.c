/* CPU kernels for fp32 inference: paged decode attention and the fused element-wise ops of a decoder
 * layer. On a CPU these ops are bound by memory traffic and by per-op dispatch, not by arithmetic: torch
 * runs an RMSNorm as five passes over the activations and a decode attention as a gather, a copy and
 * SDPA. Each function here makes one pass, reads K/V in place through the block tables, and parallelises
 * with OpenMP. Loaded after torch, the library binds to torch's own OpenMP runtime (the same libgomp.so.1),
 * so it shares torch's thread pool instead of adding threads to it.
 *
 * Plain C99 (no torch headers: it builds in about a second); written so that GCC vectorises the inner
 * loops for whatever -march=native offers. Layouts:
 *   KV pool of one layer: K [num_blocks, block_size, num_kv_heads, head_dim], V the same.
 *   q / k / v rows: token-major with a row stride (they are views into the fused qkv projection). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PAR_MIN_WORK 32768 /* below this many floats an op runs on one thread: waking the pool costs more */

/* Explicit 16-float vectors (GCC/Clang vector extensions): the compiler maps them onto AVX-512, AVX2 or
 * SSE registers. GCC does not vectorise a scalar exp written with a float/int bit cast, so exp is written
 * on vectors directly. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
#define VW 16

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
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

/* scores[t] = exp(scale q.K[t] - max) for the n cached tokens, returns their sum. The tokens' dot products
 * are independent, so the out-of-order core overlaps them; q stays in registers. */
static inline __attribute__((always_inline)) float head_scores(
    const float *qj, const float *k, const int32_t *table, int64_t n, float *sc, int64_t row, const int64_t d,
    int64_t bs, float scale) {
    if (d % VW == 0 && d <= 16 * VW) {
        vf qv[16];
        for (int64_t c = 0; c < d / VW; c++) qv[c] = vload(qj + c * VW);
        for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
            const float *kb = k + (int64_t)table[b] * bs * row;
            const int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t t = 0; t < tn; t++) {
                const float *kt = kb + t * row;
                vf a = qv[0] * vload(kt);
                for (int64_t c = 1; c < d / VW; c++) a += qv[c] * vload(kt + c * VW);
                sc[t0 + t] = hsum(a) * scale;
            }
        }
    } else {
        for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
            const float *kb = k + (int64_t)table[b] * bs * row;
            const int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t t = 0; t < tn; t++) {
                const float *kt = kb + t * row;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += qj[i] * kt[i];
                sc[t0 + t] = dot * scale;
            }
        }
    }
    return exp_shifted(sc, n);
}

/* o = (sum_t p[t] V[t]) / sum: the accumulator stays in registers. */
static inline __attribute__((always_inline)) void head_output(
    const float *p, float sum, const float *v, const int32_t *table, int64_t n, float *o, int64_t row,
    const int64_t d, int64_t bs) {
    const float inv = 1.0f / sum;
    if (d % VW == 0 && d <= 16 * VW) {
        vf acc[16];
        for (int64_t c = 0; c < d / VW; c++) acc[c] = (vf){0};
        for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
            const float *vb = v + (int64_t)table[b] * bs * row;
            const int64_t tn = n - t0 < bs ? n - t0 : bs;
            for (int64_t t = 0; t < tn; t++) {
                const float w = p[t0 + t], *vt = vb + t * row;
                for (int64_t c = 0; c < d / VW; c++) acc[c] += w * vload(vt + c * VW);
            }
        }
        for (int64_t c = 0; c < d / VW; c++) vstore(o + c * VW, acc[c] * inv);
        return;
    }
    for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
    for (int64_t b = 0, t0 = 0; t0 < n; b++, t0 += bs) {
        const float *vb = v + (int64_t)table[b] * bs * row;
        const int64_t tn = n - t0 < bs ? n - t0 : bs;
        for (int64_t t = 0; t < tn; t++) {
            const float w = p[t0 + t], *vt = vb + t * row;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) o[i] += w * vt[i];
        }
    }
    for (int64_t i = 0; i < d; i++) o[i] *= inv;
}

static inline __attribute__((always_inline)) void attend(
    const float *qj, const float *k, const float *v, const int32_t *table, int64_t n, float *sc, float *oj,
    int64_t row, const int64_t d, int64_t bs, float scale) {
    const float sum = head_scores(qj, k, table, n, sc, row, d, bs, scale);
    head_output(sc, sum, v, table, n, oj, row, d, bs);
}

/* out[s, hq, d] = softmax(scale * q[s] K_s^T) V_s for every sequence s, one query token each.
 * q rows are q_stride floats apart; lens[s] in [1, max_len]. Returns 0, or 1 if a thread could not
 * allocate its max_len-float score buffer (out is then incomplete).
 * A task is one (sequence, kv head): the query heads of its GQA group run one after another, so the
 * first brings the K/V rows into this core's cache and the others read them from there. */
int paged_decode(const float *q, int64_t q_stride, const float *k, const float *v, const int32_t *bt,
                 int64_t bt_stride, const int32_t *lens, float *out, int64_t max_len, int64_t num_seqs,
                 int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale) {
    const int64_t g = hq / hkv, row = hkv * d;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *sc = malloc(sizeof(float) * max_len);  /* one per thread, reused by its tasks */
        failed = sc == NULL;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t s = 0; s < num_seqs; s++) {
            for (int64_t h = 0; h < hkv; h++) {
                if (sc == NULL) continue;
                const float *kh = k + h * d, *vh = v + h * d;
                const int32_t *table = bt + s * bt_stride;
                for (int64_t j = h * g; j < (h + 1) * g; j++) {
                    const float *qj = q + s * q_stride + j * d;
                    float *oj = out + (s * hq + j) * d;
                    if (d == 64)
                        attend(qj, kh, vh, table, lens[s], sc, oj, row, 64, bs, scale);
                    else if (d == 128)
                        attend(qj, kh, vh, table, lens[s], sc, oj, row, 128, bs, scale);
                    else
                        attend(qj, kh, vh, table, lens[s], sc, oj, row, d, bs, scale);
                }
            }
        }
        free(sc);
    }
    return failed;
}

/* ---- KV store --------------------------------------------------------------------------------------- */

/* Copy each token's K and V rows (width floats, rows `stride` floats apart) into pool slot slots[i];
 * a negative slot is padding and is skipped. */
void store_kv(const float *k, const float *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
              int64_t width, float *kc, float *vc) {
#pragma omp parallel for if (num_tokens * width > PAR_MIN_WORK)
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        memcpy(kc + slots[i] * width, k + i * stride, sizeof(float) * width);
        memcpy(vc + slots[i] * width, v + i * stride, sizeof(float) * width);
    }
}

/* ---- element-wise ops of a decoder layer ------------------------------------------------------------ */

/* out = weight * rmsnorm(h), with h = x + residual written back to residual when add is set (the
 * residual stream of the next op), else h = x. Rows of `dim` contiguous floats. */
void rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
              float eps, int add) {
#pragma omp parallel for if (rows * dim > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *hr = add ? residual + r * dim : (float *)xr, *orow = out + r * dim;
        float ss = 0.0f;
        if (add) {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                const float h = hr[i] + xr[i];
                hr[i] = h;
                ss += h * h;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += hr[i] * hr[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) orow[i] = weight[i] * (hr[i] * inv);
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the gate and up halves of the fused projection. */
void silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows * inter > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) {
            const vf x = vload(g + i);
            vstore(o + i, x / (1.0f + exp_v(-x)) * vload(u + i));
        }
        if (i < inter) {
            float neg[VW], e[VW];
            for (int64_t j = 0; i + j < inter; j++) neg[j] = -g[i + j];
            exp_tail(neg, e, inter - i, 0.0f);
            for (int64_t j = 0; i + j < inter; j++) o[i + j] = g[i + j] / (1.0f + e[j]) * u[i + j];
        }
    }
}

/* Rotary embedding in place on the first `heads` heads of each row (the q and k heads of the fused qkv
 * projection): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves of each head, with the
 * cos/sin rows of the token's position (tables [max_pos, d], both halves equal, as transformers builds). */
void rope(float *x, int64_t stride, int64_t rows, int64_t heads, int64_t d, const int64_t *positions,
          const float *cos_t, const float *sin_t) {
    const int64_t half = d / 2;
#pragma omp parallel for if (rows * heads * d > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + positions[r] * d, *s = sin_t + positions[r] * d;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * stride + h * d, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}
