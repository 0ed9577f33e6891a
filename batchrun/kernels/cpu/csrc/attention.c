/* Paged attention for every query row of a step, decode and prefill alike, reading K and V in place through the
 * block tables (vector kernel; AMX tiles for bf16 prefill; int8 / fp8 pools widened a chunk at a time), and the KV
 * store that fills the pool. A layer's pool: K [num_blocks, block_size, num_kv_heads, head_dim], V the same.
 * Tasks (a tile of rows of one sequence, with all or one of its kv heads) are claimed dynamically, largest first. */
#include "common.h"

#if (defined(__clang__) || __GNUC__ >= 12) && VW == 16
#define HAVE_SHUFFLE 1
/* sums16(a)[j] = hsum(a[j]) for 16 vectors, by a tree of 15 shuffle-and-add pairs (not 16 horizontal sums). */
ALWAYS vf sums16(vf *a) {
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

/* ---- paged attention (decode, prefill and extend rows alike) ----------------------------------------- */

/* Each row attends to keys [0, n) of its sequence (a prefill token at p is a decode over [0, p]); its scores,
 * softmax and sum of V are taken key by key in the same order however rows are tiled or threaded, so a row's
 * output never depends on its batch. A tile is up to TILE_ROWS rows of one sequence; each chunk of KEY_CHUNK keys
 * serves, while in L1, every row of the tile and every query head of the GQA group. */
#define TILE_ROWS 16
#define KEY_CHUNK 64

/* off[t] = where key t's row starts in the pool (in elements; add h * d for kv head h), for t < n. */
static void key_offsets(const int32_t *table, int64_t n, int64_t bs, int64_t row, int64_t *off) {
    for (int64_t b = 0, t = 0; t < n; b++) {
        const int64_t base = (int64_t)table[b] * bs * row;
        for (int64_t o = 0; o < bs && t < n; o++, t++) off[t] = base + o * row;
    }
}

/* A cursor over the K and V rows a tile reads next, fetched a line at a time as it computes (scattered rows defeat
 * the hardware prefetchers, and a whole chunk at once stalls on the line fill buffers). */
typedef struct {
    const char *k, *v;  /* the task's first kv head in key 0's row (an element offset of off[] from there) */
    const int64_t *off; /* the tile's key offsets (key_offsets) */
    int64_t key, end, line, lines, elsize;
} Fetch;
ALWAYS void fetch_lines(Fetch *f, int64_t n) {
    for (int64_t i = 0; i < n && f->key < f->end; i++) {
        const int64_t at = f->off[f->key] * f->elsize + 64 * f->line;
        __builtin_prefetch(f->k + at);
        __builtin_prefetch(f->v + at);
        if (++f->line == f->lines) {
            f->line = 0;
            f->key++;
        }
    }
}

/* a[j] = the partial sums of q.K[j] for the m keys at off[0..m): fp32 FMAs, or vdpbf16ps when qb is set. */
#if HAVE_DPBF16
#define QB_PARAM , const __m512bh *qb
#else
#define QB_PARAM , const void *qb
#endif
ALWAYS void group_dots(vf *a, const vf *qv QB_PARAM, const void *kh, const int64_t *off, const int64_t m,
                       Fetch *f, const int64_t d, const int bf) {
#pragma GCC unroll 16
    for (int64_t j = 0; j < m; j++) {
        fetch_lines(f, 1);
        const void *kt = at(kh, off[j], bf);
#if HAVE_DPBF16
        if (qb != NULL) {
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
}

#if HAVE_AVX2_ATTENTION

/* Lane j = the sum of a[j]'s 8 lanes, the same tree for every j (sums16's 8-lane counterpart). */
static inline __m256 sums8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* a[j] = the partial sums of q.K[j] for the m <= 8 keys at off[0..m) (zeros past m); q's d / 8 vectors in qv. */
ALWAYS void dots8(__m256 *a, const __m256 *qv, const void *kh, const int64_t *off, const int64_t m, Fetch *f,
                  const int64_t d, const int bf) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; j++) {
        if (j >= m) {
            a[j] = _mm256_setzero_ps();
            continue;
        }
        fetch_lines(f, 1);
        const void *kt = at(kh, off[j], bf);
        __m256 acc = _mm256_mul_ps(qv[0], ld8(kt, 0, bf));
        for (int64_t c = 1; c < d / 8; c++) acc = _mm256_fmadd_ps(qv[c], ld8(kt, 8 * c, bf), acc);
        a[j] = acc;
    }
}

/* chunk_scores for d a multiple of 8 up to 128, 8 keys at a time: q and 8 sums fill AVX2's 16 registers. */
ALWAYS void chunk_scores8(const void *qj, const void *kh, const int64_t *off, int64_t t0, int64_t t1, Fetch *f,
                          float *sc, const int64_t d, float scale, const int bf) {
    __m256 qv[16];
    for (int64_t c = 0; c < d / 8; c++) qv[c] = ld8(qj, 8 * c, bf);
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t g0 = t0; g0 < t1; g0 += 8) {
        __m256 a[8];
        if (t1 - g0 >= 8) /* a constant trip count: unrolled, a[] stays in registers */
            dots8(a, qv, kh, off + g0, 8, f, d, bf);
        else
            dots8(a, qv, kh, off + g0, t1 - g0, f, d, bf);
        _mm256_storeu_ps(sc + g0, _mm256_mul_ps(sums8(a), sv));
    }
}

/* chunk_pv for d a multiple of 8 and nh <= 3 heads, 32 dims at a time (the accumulators fill AVX2's registers);
 * each dim's sum is chunk_pv's chain over the keys in order. */
ALWAYS void chunk_pv8(const float *p, int64_t cap, const void *vh, const int64_t *off, int64_t t0, int64_t t1,
                      float *acc, Fetch *f, const int64_t nh, const int64_t d, const int bf) {
    for (int64_t s0 = 0; s0 < d; s0 += 32) {
        const int64_t nv = (d - s0 < 32 ? d - s0 : 32) / 8;
        __m256 a[3][4];
        for (int64_t h = 0; h < nh; h++)
            for (int64_t c = 0; c < nv; c++) a[h][c] = _mm256_loadu_ps(acc + h * d + s0 + 8 * c);
        for (int64_t t = t0; t < t1; t++) {
            fetch_lines(f, 1);
            const void *vt = at(vh, off[t], bf);
            for (int64_t h = 0; h < nh; h++) {
                const __m256 w = _mm256_broadcast_ss(p + h * cap + t);
                for (int64_t c = 0; c < nv; c++) a[h][c] = _mm256_fmadd_ps(w, ld8(vt, s0 + 8 * c, bf), a[h][c]);
            }
        }
        for (int64_t h = 0; h < nh; h++)
            for (int64_t c = 0; c < nv; c++) _mm256_storeu_ps(acc + h * d + s0 + 8 * c, a[h][c]);
    }
}
#endif

/* sc[t] = scale * q.K[t] for t in [t0, t1), t0 a multiple of VW (sc has room to VW past t1); a score depends on
 * q and K[t] only, whichever keys share its group. */
ALWAYS void chunk_scores(const void *qj, const void *kh, const int64_t *off, int64_t t0, int64_t t1, Fetch *f,
                         float *sc, const int64_t d, float scale, const int bf) {
#if HAVE_AVX2_ATTENTION
    if (d % 8 == 0 && d <= 128) {
        chunk_scores8(qj, kh, off, t0, t1, f, sc, d, scale, bf);
        return;
    }
#endif
#if HAVE_SHUFFLE
    if (d % VW == 0 && d <= 16 * VW) {
#if HAVE_DPBF16
        __m512bh qb[8];
        const int use_dp = bf && d % 32 == 0 && d <= 8 * 32;
        if (use_dp)
            for (int64_t c = 0; c < d / 32; c++) memcpy(&qb[c], (const bf16 *)qj + c * 32, 64);
        const __m512bh *qbp = use_dp ? qb : NULL;
#else
        const int use_dp = 0;
        const void *qbp = NULL;
#endif
        vf qv[16];
        if (!use_dp)
            for (int64_t c = 0; c < d / VW; c++) qv[c] = ldv(qj, c * VW, bf);
        for (int64_t g0 = t0; g0 < t1; g0 += VW) {
            const int64_t m = t1 - g0 < VW ? t1 - g0 : VW;
            vf a[VW];
            if (m == VW) /* a constant trip count: unrolled, a[] stays in registers */
                group_dots(a, qv, qbp, kh, off + g0, VW, f, d, bf);
            else
                group_dots(a, qv, qbp, kh, off + g0, m, f, d, bf);
            for (int64_t j = m; j < VW; j++) a[j] = (vf){0};
            vstore(sc + g0, sums16(a) * scale);
        }
        return;
    }
#endif
    for (int64_t t = t0; t < t1; t++) {
        fetch_lines(f, 1);
        const void *kt = at(kh, off[t], bf);
        if (d % VW == 0 && d <= 16 * VW) {
            vf a = ldv(qj, 0, bf) * ldv(kt, 0, bf);
            for (int64_t c = 1; c < d / VW; c++) a += ldv(qj, c * VW, bf) * ldv(kt, c * VW, bf);
            sc[t] = hsum(a) * scale;
        } else {
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += ld1(qj, i, bf) * ld1(kt, i, bf);
            sc[t] = dot * scale;
        }
    }
}

#if HAVE_AVX2_ATTENTION
/* exp_v on 8 lanes (the same reduction and polynomial). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    const __m256 n = _mm256_floor_ps(t);
    const __m256i ni = _mm256_cvtps_epi32(n);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
}

/* softmax_numerators on 8 lanes (16-float vectors spill AVX2's registers). */
static float softmax_numerators8(float *x, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + t));
    float lanes[8], m = -INFINITY, sum = 0.0f;
    _mm256_storeu_ps(lanes, mv);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    const __m256 mb = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), mb));
        _mm256_storeu_ps(x + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (t < n) {
        float buf[8] = {0};
        memcpy(buf, x + t, sizeof(float) * (n - t));
        _mm256_storeu_ps(buf, exp8(_mm256_sub_ps(_mm256_loadu_ps(buf), mb)));
        memcpy(x + t, buf, sizeof(float) * (n - t));
    }
    for (; t < n; t++) sum += x[t];
    _mm256_storeu_ps(lanes, acc);
    return sum + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
}
#endif

/* x[t] = exp(scale * (x[t] - max x)) in place for t < n (n >= 1); returns their sum, in a fixed order. */
static float softmax_numerators(float *x, int64_t n, float scale) {
#if HAVE_AVX2_ATTENTION
    (void)scale; /* always 1 here: amx_attend_head needs AVX-512 */
    return softmax_numerators8(x, n);
#endif
    vf mv = vsplat(-INFINITY);
    int64_t t = 0;
    for (; t + VW <= n; t += VW) {
        const vf v = vload(x + t);
        mv = vselect(v > mv, v, mv);
    }
    float m = -INFINITY, sum = 0.0f;
    for (int i = 0; i < VW; i++) m = mv[i] > m ? mv[i] : m;
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    vf acc = {0};
    for (t = 0; t + VW <= n; t += VW) {
        const vf e = exp_v((vload(x + t) - m) * scale);
        vstore(x + t, e);
        acc += e;
    }
    if (t < n) exp_tail(x + t, x + t, n - t, m, scale);
    for (; t < n; t++) sum += x[t];
    return sum + hsum(acc);
}

/* Whether chunk_pv keeps the dims permuted: bf16 V widened by interleaving with zeros (vpunpck{l,h}wd) leaves dims
 * {0-3, 8-11, 16-19, 24-27} of each 32 in the first vector; each dim's sum is the same, `unpermute` restores them. */
#if defined(__AVX512BW__)
#define PV_PERMUTED(d, bf) ((bf) && (d) % 32 == 0 && (d) <= 16 * VW)
#else
#define PV_PERMUTED(d, bf) 0
#endif
static inline void unpermute(const float *a, float *dst) { /* 32 accumulated dims */
    for (int m = 0; m < VW; m++) {
        dst[m / 4 * 8 + m % 4] = a[m];
        dst[m / 4 * 8 + 4 + m % 4] = a[VW + m];
    }
}

/* acc[h] += sum_{t in [t0, t1)} p[h][t] V[t] for nh heads, key by key in order; one V row load serves them all. */
ALWAYS void chunk_pv(const float *p, int64_t cap, const void *vh, const int64_t *off, int64_t t0, int64_t t1,
                     float *acc, Fetch *f, const int64_t nh, const int64_t d, const int bf) {
    if (d % VW == 0 && nh * d <= 16 * VW) {
        const int64_t nv = d / VW;
        vf a[16], x[16];
        for (int64_t h = 0; h < nh; h++)
            for (int64_t c = 0; c < nv; c++) a[h * nv + c] = vload(acc + h * d + c * VW);
        for (int64_t t = t0; t < t1; t++) {
            fetch_lines(f, 1);
            const void *vt = at(vh, off[t], bf);
#if defined(__AVX512BW__)
            if (PV_PERMUTED(d, bf)) {
                for (int64_t c = 0; c < nv; c += 2) {
                    const __m512i raw = _mm512_loadu_si512((const bf16 *)vt + c * VW);
                    x[c] = (vf)_mm512_unpacklo_epi16(_mm512_setzero_si512(), raw);
                    x[c + 1] = (vf)_mm512_unpackhi_epi16(_mm512_setzero_si512(), raw);
                }
            } else
#endif
                for (int64_t c = 0; c < nv; c++) x[c] = ldv(vt, c * VW, bf);
            for (int64_t h = 0; h < nh; h++) {
                const float w = p[h * cap + t];
                for (int64_t c = 0; c < nv; c++) a[h * nv + c] += w * x[c];
            }
        }
        for (int64_t h = 0; h < nh; h++)
            for (int64_t c = 0; c < nv; c++) vstore(acc + h * d + c * VW, a[h * nv + c]);
        return;
    }
    for (int64_t h = 0; h < nh; h++) {
        float *ah = acc + h * d;
        for (int64_t t = t0; t < t1; t++) {
            fetch_lines(f, 1);
            const void *vt = at(vh, off[t], bf);
            const float w = p[h * cap + t];
            for (int64_t i = 0; i < d; i++) ah[i] += w * ld1(vt, i, bf);
        }
    }
}

/* The g heads of one row's GQA group, in register-sized runs (which never changes a head's sums). */
ALWAYS void group_pv(const float *p, int64_t cap, const void *vh, const int64_t *off, int64_t t0, int64_t t1,
                     float *acc, Fetch *f, int64_t g, const int64_t d, const int bf) {
#if HAVE_AVX2_ATTENTION
    if (d % 8 == 0) {
        for (int64_t j = 0; j < g; j += 3) {
            const float *pj = p + j * cap;
            float *aj = acc + j * d;
            switch (g - j < 3 ? g - j : 3) {
                case 1: chunk_pv8(pj, cap, vh, off, t0, t1, aj, f, 1, d, bf); break;
                case 2: chunk_pv8(pj, cap, vh, off, t0, t1, aj, f, 2, d, bf); break;
                default: chunk_pv8(pj, cap, vh, off, t0, t1, aj, f, 3, d, bf); break;
            }
        }
        return;
    }
#endif
    if (d == 64) {
        for (int64_t j = 0; j < g; j += 4) {
            const float *pj = p + j * cap;
            float *aj = acc + j * d;
            switch (g - j < 4 ? g - j : 4) {
                case 1: chunk_pv(pj, cap, vh, off, t0, t1, aj, f, 1, 64, bf); break;
                case 2: chunk_pv(pj, cap, vh, off, t0, t1, aj, f, 2, 64, bf); break;
                case 3: chunk_pv(pj, cap, vh, off, t0, t1, aj, f, 3, 64, bf); break;
                default: chunk_pv(pj, cap, vh, off, t0, t1, aj, f, 4, 64, bf); break;
            }
        }
    } else if (d == 128) {
        for (int64_t j = 0; j < g; j += 2) {
            if (g - j == 1)
                chunk_pv(p + j * cap, cap, vh, off, t0, t1, acc + j * d, f, 1, 128, bf);
            else
                chunk_pv(p + j * cap, cap, vh, off, t0, t1, acc + j * d, f, 2, 128, bf);
        }
    } else {
        for (int64_t j = 0; j < g; j++) chunk_pv(p + j * cap, cap, vh, off, t0, t1, acc + j * d, f, 1, d, bf);
    }
}

typedef struct {
    int64_t seq, first, rows, max_len, cost; /* cost: the tile's keys summed over its rows */
    int64_t start; /* the first key any row of the tile attends (sliding windows), rounded down to a KEY_CHUNK */
    int64_t pack;  /* its sequence's K and V in AMX layouts (AmxPack), or -1 */
} Tile;

/* The first key a row of row_len n attends: n - window with a sliding window (window > 0), else 0. */
static inline int64_t first_key(int64_t n, int64_t window) { return window > 0 && n > window ? n - window : 0; }

/* x[t] = softcap * tanh(x[t] / softcap): Gemma 2's score soft-capping, transformers' arithmetic. */
static void soft_cap(float *x, int64_t n, float softcap) {
    for (int64_t t = 0; t < n; t++) x[t] = tanhf(x[t] / softcap) * softcap;
}

static int by_cost_descending(const void *a, const void *b) {
    const int64_t x = ((const Tile *)a)->cost, y = ((const Tile *)b)->cost;
    return (x < y) - (x > y);
}

/* One thread's scratch: scores, accumulators, sums, and the key offsets of its task and its next one. */
typedef struct {
    float *sc, *acc, *inv;
    int64_t *off, *next_off;
    void *amx;  /* amx_attend_head's buffers (AMX_ATTENTION only) */
    void *wide; /* an 8-bit pool's chunk of K or V rows widened [KEY_CHUNK][d] (attend_tile_8bit only) */
    float *ks;  /* and their int8 scales [KEY_CHUNK] */
} Scratch;

/* The fetch cursor of a task's first chunk, its key offsets written to off (elements of elsize bytes). */
static Fetch task_fetch(const Tile *tile, int64_t h0, int64_t h1, const void *k, const void *v, const int32_t *bt,
                        int64_t bt_stride, int64_t hkv, int64_t bs, int64_t width, int64_t elsize, int64_t *off) {
    if (tile->pack >= 0) return (Fetch){0}; /* an AMX tile reads its sequence's pack: nothing to fetch */
    key_offsets(bt + tile->seq * bt_stride, tile->max_len, bs, hkv * width, off);
    const int64_t bytes = (h1 - h0) * width * elsize; /* of a key's K (or V) row the task reads */
    const int64_t end = tile->start + KEY_CHUNK < tile->max_len ? tile->start + KEY_CHUNK : tile->max_len;
    const Fetch f = {(const char *)k + h0 * width * elsize, (const char *)v + h0 * width * elsize, off, tile->start,
                     end, 0, (bytes + 63) / 64, elsize};
    return f;
}

/* One tile's rows, kv heads [h0, h1), lanes (row, query head): each chunk fetches the next one's rows, the last and
 * the sums of V the next task's first chunk (`next`). With a window a row's softmax and sums take its keys
 * [first_key, n) only (scores before it are computed with the chunk, never read). */
ALWAYS void attend_tile(const Tile *tile, int64_t h0, int64_t h1, const void *q, int64_t q_stride, const void *k,
                        const void *v, const int32_t *row_len, void *out, int64_t hq, int64_t g, int64_t cap,
                        float scale, int64_t window, float softcap, Scratch s, Fetch f, Fetch *next, const int64_t d,
                        const int bf) {
    const int64_t first = tile->first, rows = tile->rows, max_len = tile->max_len;
    for (int64_t c0 = tile->start; c0 < max_len; c0 += KEY_CHUNK) {
        f.end = c0 + 2 * KEY_CHUNK < max_len ? c0 + 2 * KEY_CHUNK : max_len;
        Fetch *fp = c0 + KEY_CHUNK >= max_len && f.key >= f.end ? next : &f;
        for (int64_t h = h0; h < h1; h++) {
            const void *kh = at(k, h * d, bf);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = row_len[first + r], t1 = c0 + KEY_CHUNK < n ? c0 + KEY_CHUNK : n;
                if (n <= c0) continue;
                for (int64_t j = h * g; j < (h + 1) * g; j++) {
                    const void *qj = at(q, (first + r) * q_stride + j * d, bf);
                    chunk_scores(qj, kh, s.off, c0, t1, fp, s.sc + (r * hq + j) * cap, d, scale, bf);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = row_len[first + r], lo = first_key(n, window);
        for (int64_t j = h0 * g; j < h1 * g; j++) {
            float *x = s.sc + (r * hq + j) * cap + lo;
            if (softcap > 0.0f) soft_cap(x, n - lo, softcap);
            s.inv[r * hq + j] = n > 0 ? 1.0f / softmax_numerators(x, n - lo, 1.0f) : 0.0f;
            memset(s.acc + (r * hq + j) * d, 0, sizeof(float) * d);
        }
    }
    for (int64_t c0 = tile->start; c0 < max_len; c0 += KEY_CHUNK) {
        for (int64_t h = h0; h < h1; h++) {
            const void *vh = at(v, h * d, bf);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = row_len[first + r], t1 = c0 + KEY_CHUNK < n ? c0 + KEY_CHUNK : n;
                const int64_t lo = first_key(n, window), t0 = lo > c0 ? lo : c0;
                const int64_t lane = r * hq + h * g;
                if (t1 > t0) group_pv(s.sc + lane * cap, cap, vh, s.off, t0, t1, s.acc + lane * d, next, g, d, bf);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = h0 * g; j < h1 * g; j++) {
            const float *a = s.acc + (r * hq + j) * d, inv = s.inv[r * hq + j];
            void *o = (void *)at(out, ((first + r) * hq + j) * d, bf);
            int64_t i = 0;
            if (PV_PERMUTED(d, bf)) {
                for (; i < d; i += 2 * VW) {
                    float natural[2 * VW];
                    unpermute(a + i, natural);
                    stv(o, i, vload(natural) * inv, bf);
                    stv(o, i + VW, vload(natural + VW) * inv, bf);
                }
            }
            for (; i + VW <= d; i += VW) stv(o, i, vload(a + i) * inv, bf);
            for (; i < d; i++) st1(o, i, a[i] * inv, bf);
        }
    }
}

/* One sequence's K and V over keys [start, end) (start a multiple of 32) in the layouts the tiles read, made once a
 * call for all its AMX tiles: K per kv head, groups of 16 keys [d / 32][16 pairs][16 keys][2]; V per kv head, pairs
 * of keys interleaved [keys / 2][d][2]; zeros past end. Each is keys32 * d values a head (keys32: end - start
 * rounded up to 32). */
typedef struct {
    int64_t seq, start, end, keys32;
    bf16 *k, *v;
} AmxPack;

#if HAVE_AMX
/* bf16 attention on AMX tiles (head_dim a multiple of 32): a (row, query head) lane of a kv head's GQA group is
 * a tile row. Scores: the lanes' queries times 16 keys' K, transposed into vdpbf16ps's pair layout; softmax in
 * fp32 as the vector kernel's; p.V: p as two bf16 terms (its rounding and the rest, so p keeps 16 bits) times V
 * with pairs of keys interleaved. Each lane's sums are chains of tile products in order from key 0 (keys past its
 * length add exactly 0): batch invariant. Decode rows gain nothing here; paged_attention's amx_lanes decides. */
#define AMX_ATTENTION(d, bf) ((bf) && (d) % 32 == 0 && (d) <= 512 && amx_allowed())

typedef struct {
    bf16 *qa, *pb; /* lanes' queries [lanes][d]; p's two terms [2][lanes][cap32] */
    float *ob;     /* one lane tile's p.V sums [16][d] */
} AmxBuffers;

/* 16 keys' K into the key-pair layout: row i holds key i's 32-bit pairs [16c, 16c + 16); out row j, pair 16c + j. */
static inline void transpose16x16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) { /* 128-bit lanes: [r0 r4 r8 r12] -> rows */
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Keys [t, t + 32) of a pack, every kv head (rows of hkv heads of d values in the pool, through block table bt). */
static void amx_pack_keys(const AmxPack *p, int64_t t, const bf16 *k, const bf16 *v, const int32_t *bt, int64_t bs,
                          int64_t hkv, int64_t d) {
    const int64_t row = hkv * d;
    int64_t off[32]; /* key t + i's row in the pool */
    for (int64_t i = 0; i < 32; i++)
        off[i] = t + i < p->end ? ((int64_t)bt[(t + i) / bs] * bs + (t + i) % bs) * row : -1;
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t h = 0; h < hkv; h++) {
        bf16 *kp = p->k + (h * p->keys32 + t - p->start) * d, *vp = p->v + (h * p->keys32 + t - p->start) * d;
        for (int64_t g0 = 0; g0 < 32; g0 += 16) {
            for (int64_t c = 0; c < d / 32; c++) {
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = off[g0 + i] >= 0 ? _mm512_loadu_si512(k + off[g0 + i] + h * d + 32 * c)
                                            : _mm512_setzero_si512();
                transpose16x16(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_si512(kp + g0 * d + (16 * c + i) * 32, r[i]);
            }
        }
        for (int64_t i = 0; i < 32; i += 2) {
            const bf16 *v0 = off[i] >= 0 ? v + off[i] + h * d : NULL;
            const bf16 *v1 = off[i + 1] >= 0 ? v + off[i + 1] + h * d : NULL;
            for (int64_t e = 0; e < d; e += 32) {
                const __m512i a = v0 != NULL ? _mm512_loadu_si512(v0 + e) : _mm512_setzero_si512();
                const __m512i c = v1 != NULL ? _mm512_loadu_si512(v1 + e) : _mm512_setzero_si512();
                _mm512_storeu_si512(vp + i * d + 2 * e, _mm512_permutex2var_epi16(a, lo, c));
                _mm512_storeu_si512(vp + i * d + 2 * e + 32, _mm512_permutex2var_epi16(a, hi, c));
            }
        }
    }
}

/* One kv head h of a tile, lane r * g + j for row r and query head j, K and V read from the sequence's pack;
 * `next` fetches the next task's first keys. Keys of the pack past a lane's length have p = 0 (finite values or
 * zeros): they add exactly 0. */
static void amx_attend_head(const Tile *tile, int64_t h, const bf16 *q, int64_t q_stride, const AmxPack *pack,
                            const int32_t *row_len, bf16 *out, int64_t hq, int64_t g, int64_t cap, float scale,
                            int64_t window, float softcap, float *sc, float *inv, AmxBuffers b, Fetch *next,
                            int64_t d) {
    const int64_t first = tile->first, rows = tile->rows, max_len = tile->max_len, lanes = rows * g;
    const int64_t lane_tiles = (lanes + 15) / 16, cap32 = (cap + 31) / 32 * 32, key_chunks = (max_len + 31) / 32;
    const int64_t start = tile->start, first_chunk = start / 32; /* a sliding window's first key chunk */
    /* kv head h's packed K and V, from key pack->start */
    const bf16 *kp = pack->k + h * pack->keys32 * d, *vp = pack->v + h * pack->keys32 * d;
    /* (the last lane tile's padding lanes are never read) */
    for (int64_t l = 0; l < lanes; l++) memcpy(b.qa + l * d, q + (first + l / g) * q_stride + (h * g + l % g) * d, 2 * d);
    /* scores */
    for (int64_t t0 = start; t0 < max_len; t0 += 16) {
        fetch_lines(next, 2);
        for (int64_t mt = 0; mt < lane_tiles; mt++) {
            _tile_zero(0);
            for (int64_t c = 0; c < d / 32; c++) {
                _tile_loadd(1, b.qa + mt * 16 * d + 32 * c, d * 2);
                _tile_loadd(2, kp + (t0 - pack->start) * d + c * 16 * 32, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, sc + mt * 16 * cap + t0, cap * 4);
        }
    }
    /* softmax over each lane's keys [lo, n); p in bf16, zero outside them */
    for (int64_t l = 0; l < lanes; l++) {
        const int64_t n = row_len[first + l / g], lo = first_key(n, window);
        float *x = sc + l * cap;
        float lane_scale = scale;
        if (softcap > 0.0f) { /* scaled first, as the vector kernel's scores come */
            for (int64_t t = lo; t < n; t++) x[t] *= scale;
            soft_cap(x + lo, n - lo, softcap);
            lane_scale = 1.0f;
        }
        inv[l] = n > 0 ? 1.0f / softmax_numerators(x + lo, n - lo, lane_scale) : 0.0f;
        for (int64_t t = first_chunk * 32; t < key_chunks * 32; t += 16) {
            const int64_t m = n - t < 0 ? 0 : n - t < 16 ? n - t : 16, skip = lo - t < 0 ? 0 : lo - t < 16 ? lo - t : 16;
            const __mmask16 keep = (__mmask16)(((1u << m) - 1) & ~((1u << skip) - 1));
            const vf p = keep ? (vf)_mm512_maskz_loadu_ps(keep, x + t) : (vf){0};
            vstore_bf16(b.pb + l * cap32 + t, p);
            vstore_bf16(b.pb + (lane_tiles * 16 + l) * cap32 + t, p - vload_bf16(b.pb + l * cap32 + t));
        }
    }
    /* p.V, 64 dims (four C tiles) at a time, and the outputs */
    for (int64_t mt = 0; mt < lane_tiles; mt++) {
        for (int64_t e0 = 0; e0 < d; e0 += 64) {
            const int64_t nc = (d - e0) / 16 < 4 ? (d - e0) / 16 : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kc = first_chunk; kc < key_chunks; kc++) {
                const bf16 *vbc = vp + (kc * 32 - pack->start) * d + 2 * e0; /* pair rows d * 4 bytes apart */
                _tile_loadd(4, b.pb + mt * 16 * cap32 + 32 * kc, cap32 * 2);
                _tile_loadd(6, b.pb + (lane_tiles + mt) * 16 * cap32 + 32 * kc, cap32 * 2);
                _tile_loadd(5, vbc, d * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(0, 6, 5);
                _tile_loadd(5, vbc + 32, d * 4);
                _tile_dpbf16ps(1, 4, 5);
                _tile_dpbf16ps(1, 6, 5);
                if (nc > 2) {
                    _tile_loadd(5, vbc + 64, d * 4);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_dpbf16ps(2, 6, 5);
                    _tile_loadd(5, vbc + 96, d * 4);
                    _tile_dpbf16ps(3, 4, 5);
                    _tile_dpbf16ps(3, 6, 5);
                }
            }
            _tile_stored(0, b.ob + e0, d * 4);
            _tile_stored(1, b.ob + e0 + 16, d * 4);
            if (nc > 2) {
                _tile_stored(2, b.ob + e0 + 32, d * 4);
                _tile_stored(3, b.ob + e0 + 48, d * 4);
            }
        }
        for (int64_t l = mt * 16; l < lanes && l < mt * 16 + 16; l++) {
            bf16 *o = out + ((first + l / g) * hq + h * g + l % g) * d;
            const vf s = vsplat(inv[l]);
            for (int64_t e = 0; e < d; e += 16) vstore_bf16(o + e, vload(b.ob + (l - mt * 16) * d + e) * s);
        }
    }
}
#endif

/* A pool's format: K/V in the query's dtype, int8 rows with their scale, or fp8 bytes. */
enum { KV_FLOAT, KV_INT8, KV_E4M3, KV_E5M2 };
/* An int8 pool's (slot, kv head) row: head_dim int8 values, then their float32 scale. */
#define Q8_ROW(d) ((d) + 4)

/* The arguments every task of one call shares. */
typedef struct {
    const void *q, *k, *v;
    const int32_t *row_len;
    void *out;
    int64_t q_stride, hq, g, cap, d;
    float scale;
    int64_t amx_lanes; /* the fewest lanes (rows x query heads of a kv head) a tile takes to AMX; 0: none */
    int64_t window;    /* a sliding window (keys a row sees: itself and window - 1 before it); 0: none */
    float softcap;     /* scores soft-capped to softcap * tanh(s / softcap); 0: not */
    int64_t width;     /* pool elements of a (slot, kv head) row: d, or Q8_ROW(d) in an int8 pool */
    int kv;            /* the pool's format (KV_FLOAT, KV_INT8, KV_E4M3, KV_E5M2) */
    const AmxPack *packs; /* of the sequences with AMX tiles (Tile.pack) */
} AttentionCall;

/* One task, the dtype a constant again (attend_task_fp32 / _bf16: the region is outlined before inlining). */
ALWAYS void attend_task(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                        Fetch *next, const int bf) {
#if HAVE_AMX
    if (bf && tile->pack >= 0) {
        for (int64_t h = h0; h < h1; h++)
            amx_attend_head(tile, h, c->q, c->q_stride, &c->packs[tile->pack], c->row_len, c->out, c->hq, c->g, c->cap,
                            c->scale, c->window, c->softcap, s.sc, s.inv, *(AmxBuffers *)s.amx, next, c->d);
        return;
    }
#endif
    if (c->d == 64)
        attend_tile(tile, h0, h1, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale,
                    c->window, c->softcap, s, own, next, 64, bf);
    else if (c->d == 128)
        attend_tile(tile, h0, h1, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale,
                    c->window, c->softcap, s, own, next, 128, bf);
    else
        attend_tile(tile, h0, h1, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale,
                    c->window, c->softcap, s, own, next, c->d, bf);
}
static void attend_task_fp32(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                             Fetch *next) {
    attend_task(c, tile, h0, h1, s, own, next, 0);
}
static void attend_task_bf16(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                             Fetch *next) {
    attend_task(c, tile, h0, h1, s, own, next, 1);
}

/* ---- attention over an 8-bit pool (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2) ------------------------------ */

/* An 8-bit pool runs on the float kernel's code: each chunk of a kv head's K (then V) rows is widened once into an
 * L1 buffer (Scratch.wide) that every row and query head of the tile reads; the arithmetic stays batch invariant. */
/* VW bytes from p as int32, sign- or zero-extended (one vpmov{s,z}xbd: GCC makes scalar code of the generic form). */
ALWAYS vi widen_bytes(const int8_t *p, const int sign) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return (vi)(sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    return (vi)(sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vi x;
    for (int i = 0; i < VW; i++) x[i] = sign ? (int32_t)p[i] : (int32_t)(uint8_t)p[i];
    return x;
#endif
}

/* VW values of an 8-bit row as fp32: int8 as its integers (the scale is the caller's), fp8 exactly torch's values,
 * its bits moved into an fp32's (e4m3fn: no infinities, S.1111.111 is NaN; e5m2 as fp16). */
ALWAYS vf widen8(const int8_t *p, const int kv) {
    if (kv == KV_INT8) return __builtin_convertvector(widen_bytes(p, 1), vf);
#if defined(__F16C__) && (VW == 16 || defined(__AVX2__))
    /* through fp16: e5m2 is its top half, e4m3fn's bits one place down are value / 256 (its NaN made one first) */
    typedef int16_t vs16 __attribute__((vector_size(2 * VW)));
#if VW == 16
    vh h = (vh)_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
#else
    vh h = (vh)_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8);
#endif
    if (kv == KV_E4M3) {
        h = ((h >> 1) & 0x3fffu) | (h & 0x8000u);
        const vs16 nan = (h & 0x7fffu) == 0x3f80u;
        h = ((vh)nan & 0x7e00u) | ((vh)~nan & h);
    }
#if VW == 16
    const vf x = (vf)_mm512_cvtph_ps((__m256i)h);
#else
    const vf x = (vf)_mm256_cvtph_ps((__m128i)h);
#endif
    return kv == KV_E4M3 ? x * 256.0f : x;
#else
    const vu u = (vu)widen_bytes(p, 0), mag = u & 0x7fu;
    const int m = kv == KV_E4M3 ? 3 : 2; /* mantissa bits; the exponent's bias is 7 or 15 */
    const vu normal = (mag << (23 - m)) + ((kv == KV_E4M3 ? 127u - 7u : 127u - 15u) << 23);
    const vf sub = __builtin_convertvector((vi)mag, vf) * (kv == KV_E4M3 ? 0x1p-9f : 0x1p-16f);
    vf x = vselect(mag < (1u << m), sub, (vf)normal);
    if (kv == KV_E4M3)
        x = vselect(mag == 0x7fu, (vf)((vu){0} + 0x7fc00000u), x);
    else
        x = vselect(mag >= 0x7cu, (vf)((mag << 21) | 0x7f800000u), x);
    return (vf)((vu)x | (u & 0x80u) << 24);
#endif
}

/* Keys [t0, t1) of one kv head's 8-bit rows widened into dst [t1 - t0][d], fp32 or (to_bf) exact bf16; int8
 * values times their scale when fold, else integers with the scales in ks. Each row fetches `per` lines ahead. */
ALWAYS void widen_rows(const int8_t *kh, const int64_t *off, int64_t t0, int64_t t1, void *dst, float *ks, Fetch *f,
                       int64_t per, const int64_t d, const int kv, const int to_bf, const int fold) {
    for (int64_t t = t0; t < t1; t++) {
        fetch_lines(f, per);
        const int8_t *row = kh + off[t];
        const int64_t base = (t - t0) * d;
        float scale = 1.0f;
        if (kv == KV_INT8) memcpy(&scale, row + d, 4);
        ks[t - t0] = scale;
        int64_t i = 0;
        for (; i + VW <= d; i += VW) {
            vf x = widen8(row + i, kv);
            if (kv == KV_INT8 && fold) x *= scale;
            stv(dst, base + i, x, to_bf);
        }
        if (i < d) { /* a partial vector, through a padded copy (an fp8 pool's last row ends the buffer) */
            int8_t pad[VW] = {0};
            float w[VW];
            memcpy(pad, row + i, d - i);
            vf x = widen8(pad, kv);
            if (kv == KV_INT8 && fold) x *= scale;
            vstore(w, x);
            for (int64_t e = i; e < d; e++) st1(dst, base + e, w[e - i], to_bf);
        }
    }
}

/* widen_rows with the pool's format made a constant (once per chunk). */
ALWAYS void widen_chunk(int kv, const int8_t *kh, const int64_t *off, int64_t t0, int64_t t1, void *dst, float *ks,
                        Fetch *f, int64_t per, const int64_t d, const int to_bf, const int fold) {
    if (kv == KV_INT8)
        widen_rows(kh, off, t0, t1, dst, ks, f, per, d, KV_INT8, to_bf, fold);
    else if (kv == KV_E4M3)
        widen_rows(kh, off, t0, t1, dst, ks, f, per, d, KV_E4M3, to_bf, fold);
    else
        widen_rows(kh, off, t0, t1, dst, ks, f, per, d, KV_E5M2, to_bf, fold);
}

#if VW == 16 && !HAVE_AVX2_ATTENTION
#define HAVE_DIRECT_PV 1
/* chunk_pv on 8-bit V rows read in place, for a tile of one row: the same arithmetic as chunk_pv over
 * widen_rows' fp32 values, so a row's bits are those it gets in a tile of many. */
ALWAYS void chunk_pv_8bit(const float *p, int64_t cap, const int8_t *vh, const int64_t *off, int64_t t0, int64_t t1,
                          float *acc, Fetch *f, const int64_t nh, const int64_t d, const int kv) {
    const int64_t nv = d / VW;
    vf a[16], x[16];
    for (int64_t h = 0; h < nh; h++)
        for (int64_t c = 0; c < nv; c++) a[h * nv + c] = vload(acc + h * d + c * VW);
    for (int64_t t = t0; t < t1; t++) {
        fetch_lines(f, 1);
        const int8_t *vt = vh + off[t];
        float scale = 1.0f;
        if (kv == KV_INT8) memcpy(&scale, vt + d, 4);
        for (int64_t c = 0; c < nv; c++) {
            x[c] = widen8(vt + c * VW, kv);
            if (kv == KV_INT8) x[c] *= scale;
        }
        for (int64_t h = 0; h < nh; h++) {
            const float w = p[h * cap + t];
            for (int64_t c = 0; c < nv; c++) a[h * nv + c] += w * x[c];
        }
    }
    for (int64_t h = 0; h < nh; h++)
        for (int64_t c = 0; c < nv; c++) vstore(acc + h * d + c * VW, a[h * nv + c]);
}

/* group_pv's runs of heads for chunk_pv_8bit (d = 64: 4 heads, 128: 2; d a multiple of 16 up to 256: 1). */
ALWAYS void group_pv_8bit(const float *p, int64_t cap, const int8_t *vh, const int64_t *off, int64_t t0, int64_t t1,
                          float *acc, Fetch *f, int64_t g, const int64_t d, const int kv) {
    const int64_t run = d == 64 ? 4 : d == 128 ? 2 : 1;
    for (int64_t j = 0; j < g; j += run) {
        const float *pj = p + j * cap;
        float *aj = acc + j * d;
        switch (g - j < run ? g - j : run) {
            case 1: chunk_pv_8bit(pj, cap, vh, off, t0, t1, aj, f, 1, d, kv); break;
            case 2: chunk_pv_8bit(pj, cap, vh, off, t0, t1, aj, f, 2, d, kv); break;
            case 3: chunk_pv_8bit(pj, cap, vh, off, t0, t1, aj, f, 3, d, kv); break;
            default: chunk_pv_8bit(pj, cap, vh, off, t0, t1, aj, f, 4, d, kv); break;
        }
    }
}
#define DIRECT_PV(rows, d) ((rows) == 1 && (d) % 16 == 0 && (d) <= 256)
#else
#define HAVE_DIRECT_PV 0
#define DIRECT_PV(rows, d) 0
#endif

/* Keys widened at a time: 16 KB of fp32 (half a typical L1), a multiple of 16 from 16 to KEY_CHUNK. */
static inline int64_t wide_keys(int64_t d) {
    const int64_t n = 4096 / d / 16 * 16;
    return n < 16 ? 16 : n > KEY_CHUNK ? KEY_CHUNK : n;
}

/* attend_tile over an 8-bit pool: K widened to fp32 values times their scale for fp32 queries, or to exact bf16
 * integers for bf16 ones (vdpbf16ps), each score then times its key's scale; V to fp32 times its scale, or for a
 * decode row on AVX-512 straight into registers (chunk_pv_8bit). */
ALWAYS void attend_tile_8bit(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch f,
                             Fetch *next, const int64_t d, const int bf) {
    const int64_t first = tile->first, rows = tile->rows, max_len = tile->max_len, hq = c->hq, g = c->g;
    const int64_t cap = c->cap, kc = wide_keys(d), per = (f.lines + (h1 - h0) - 1) / (h1 - h0);
    const int8_t *k = c->k, *v = c->v;
    int64_t ident[KEY_CHUNK]; /* the widened keys' offsets in s.wide */
    for (int64_t i = 0; i < kc; i++) ident[i] = i * d;
    Fetch none = {0}; /* chunk_scores and group_pv fetch nothing: widen_rows does */
    for (int64_t c0 = tile->start; c0 < max_len; c0 += kc) {
        const int64_t c1 = c0 + kc < max_len ? c0 + kc : max_len;
        f.end = c1 + KEY_CHUNK < max_len ? c1 + KEY_CHUNK : max_len;
        Fetch *fp = c1 >= max_len && f.key >= f.end ? next : &f;
        for (int64_t h = h0; h < h1; h++) {
            widen_chunk(c->kv, k + h * c->width, s.off, c0, c1, s.wide, s.ks, fp, per, d, bf, !bf);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = c->row_len[first + r], t1 = c1 < n ? c1 : n;
                if (n <= c0) continue;
                for (int64_t j = h * g; j < (h + 1) * g; j++) {
                    float *x = s.sc + (r * hq + j) * cap + c0;
                    chunk_scores(at(c->q, (first + r) * c->q_stride + j * d, bf), s.wide, ident, 0, t1 - c0, &none, x,
                                 d, c->scale, bf);
                    if (bf && c->kv == KV_INT8)
                        for (int64_t t = 0; t < t1 - c0; t++) x[t] *= s.ks[t];
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = c->row_len[first + r], lo = first_key(n, c->window);
        for (int64_t j = h0 * g; j < h1 * g; j++) {
            float *x = s.sc + (r * hq + j) * cap + lo;
            if (c->softcap > 0.0f) soft_cap(x, n - lo, c->softcap);
            s.inv[r * hq + j] = n > 0 ? 1.0f / softmax_numerators(x, n - lo, 1.0f) : 0.0f;
            memset(s.acc + (r * hq + j) * d, 0, sizeof(float) * d);
        }
    }
#if HAVE_DIRECT_PV
    if (DIRECT_PV(rows, d)) { /* one row: lanes h * g + j */
        const int64_t n = c->row_len[first], lo = first_key(n, c->window);
        for (int64_t h = h0; h < h1; h++) {
            const int8_t *vh = v + h * c->width;
            float *p = s.sc + h * g * cap, *acc = s.acc + h * g * d;
            if (c->kv == KV_INT8)
                group_pv_8bit(p, cap, vh, s.off, lo, n, acc, next, g, d, KV_INT8);
            else if (c->kv == KV_E4M3)
                group_pv_8bit(p, cap, vh, s.off, lo, n, acc, next, g, d, KV_E4M3);
            else
                group_pv_8bit(p, cap, vh, s.off, lo, n, acc, next, g, d, KV_E5M2);
        }
    }
#endif
    for (int64_t c0 = tile->start; c0 < max_len && !DIRECT_PV(rows, d); c0 += kc) {
        const int64_t c1 = c0 + kc < max_len ? c0 + kc : max_len;
        for (int64_t h = h0; h < h1; h++) {
            widen_chunk(c->kv, v + h * c->width, s.off, c0, c1, s.wide, s.ks, next, 1, d, 0, 1);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = c->row_len[first + r], t1 = c1 < n ? c1 : n;
                const int64_t lo = first_key(n, c->window), t0 = lo > c0 ? lo : c0, lane = r * hq + h * g;
                if (t1 > t0)
                    group_pv(s.sc + lane * cap + c0, cap, s.wide, ident, t0 - c0, t1 - c0, s.acc + lane * d, &none, g,
                             d, 0);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = h0 * g; j < h1 * g; j++) {
            const float *a = s.acc + (r * hq + j) * d, inv = s.inv[r * hq + j];
            void *o = (void *)at(c->out, ((first + r) * hq + j) * d, bf);
            int64_t i = 0;
            for (; i + VW <= d; i += VW) stv(o, i, vload(a + i) * inv, bf);
            for (; i < d; i++) st1(o, i, a[i] * inv, bf);
        }
    }
}

/* One task over an 8-bit pool, the query dtype and the common head_dims constants (as attend_task). */
ALWAYS void attend_task_8bit(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                             Fetch *next, const int bf) {
    if (c->d == 64)
        attend_tile_8bit(c, tile, h0, h1, s, own, next, 64, bf);
    else if (c->d == 128)
        attend_tile_8bit(c, tile, h0, h1, s, own, next, 128, bf);
    else
        attend_tile_8bit(c, tile, h0, h1, s, own, next, c->d, bf);
}
static void attend_task_8bit_fp32(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s,
                                  Fetch own, Fetch *next) {
    attend_task_8bit(c, tile, h0, h1, s, own, next, 0);
}
static void attend_task_8bit_bf16(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s,
                                  Fetch own, Fetch *next) {
    attend_task_8bit(c, tile, h0, h1, s, own, next, 1);
}

/* out[i] = softmax(scale * q[i] K^T) V over keys [0, row_len[i]) of sequence row_seq[i] (block table row
 * row_seq[i] of bt), q rows q_stride apart, out contiguous [num_rows, hq, d], fp32 or bf16; a row with row_len 0
 * gets zeros. amx_lanes: the fewest lanes of a bf16 tile that go to AMX (0: none). window > 0: keys
 * [row_len - window, row_len) only (earlier blocks never read); softcap > 0: scores soft-capped. 1 without memory. */
static int attend_rows(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                       int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out, int64_t num_rows,
                       int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf, int64_t amx_lanes,
                       int64_t window, float softcap, int kv) {
    const int64_t g = hq / hkv;
    Tile *tiles = malloc(sizeof(Tile) * (num_rows > 0 ? num_rows : 1));
    if (tiles == NULL) return 1;
    int64_t num_tiles = 0, cap = 0, work = 0;
    for (int64_t i = 0; i < num_rows;) {
        Tile t = {row_seq[i], i, 0, 0, 0, row_len[i], -1};
        for (; i < num_rows && row_seq[i] == t.seq && t.rows < TILE_ROWS; i++, t.rows++) {
            const int64_t lo = first_key(row_len[i], window);
            t.max_len = row_len[i] > t.max_len ? row_len[i] : t.max_len;
            t.start = lo < t.start ? lo : t.start;
            t.cost += row_len[i] - lo;
        }
        t.start = t.start / KEY_CHUNK * KEY_CHUNK;
        tiles[num_tiles++] = t;
        cap = t.max_len > cap ? t.max_len : cap;
        work += t.cost;
    }
#if HAVE_AMX
    if (!AMX_ATTENTION(d, bf) || kv != KV_FLOAT) amx_lanes = 0;
#else
    amx_lanes = 0;
#endif
    /* the sequences of the AMX tiles (a sequence's tiles are adjacent here), each packed once for all of them */
    AmxPack *packs = malloc(sizeof(AmxPack) * (num_tiles > 0 ? num_tiles : 1));
    int64_t *pack_units = malloc(sizeof(int64_t) * (num_tiles + 1)); /* the first 32-key unit of each pack */
    int64_t num_packs = 0, pack_values = 0;
    bf16 *pack_buffer = NULL;
    if (packs == NULL || pack_units == NULL) goto no_memory;
    for (int64_t i = 0; i < num_tiles && amx_lanes > 0; i++) {
        Tile *t = &tiles[i];
        if (t->rows * g < amx_lanes) continue;
        if (num_packs == 0 || packs[num_packs - 1].seq != t->seq)
            packs[num_packs++] = (AmxPack){t->seq, t->start, t->max_len, 0, NULL, NULL};
        AmxPack *pk = &packs[num_packs - 1];
        pk->start = t->start < pk->start ? t->start : pk->start;
        pk->end = t->max_len > pk->end ? t->max_len : pk->end;
        t->pack = num_packs - 1;
    }
    pack_units[0] = 0;
    for (int64_t i = 0; i < num_packs; i++) {
        packs[i].keys32 = (packs[i].end - packs[i].start + 31) / 32 * 32;
        pack_units[i + 1] = pack_units[i] + packs[i].keys32 / 32;
        pack_values += 2 * hkv * packs[i].keys32 * d;
    }
    if (num_packs > 0) {
        if ((pack_buffer = malloc(sizeof(bf16) * pack_values)) == NULL) goto no_memory;
        for (int64_t i = 0, used = 0; i < num_packs; used += 2 * hkv * packs[i].keys32 * d, i++) {
            packs[i].k = pack_buffer + used;
            packs[i].v = pack_buffer + used + hkv * packs[i].keys32 * d;
        }
    }
    const int64_t num_units = pack_units[num_packs];
    /* largest first, so that the dynamic schedule ends on small tasks (the order changes no result) */
    qsort(tiles, num_tiles, sizeof(Tile), by_cost_descending);
    cap = (cap + VW - 1) / VW * VW;
    const int64_t width = kv == KV_INT8 ? Q8_ROW(d) : d, elsize = kv != KV_FLOAT ? 1 : bf ? 2 : 4;
    const AttentionCall call = {q,         k,      v,       row_len, out,   q_stride, hq, g, cap, d, scale,
                                amx_lanes, window, softcap, width,   kv,  packs};
    /* a task takes all kv heads of a tile (whole rows, in address order), or one when tiles are too few */
    const int64_t heads_per_task = num_tiles >= 8 * omp_get_max_threads() ? hkv : 1;
    const int64_t tasks_per_tile = hkv / heads_per_task, num_tasks = num_tiles * tasks_per_tile;
    const int64_t lanes = TILE_ROWS * hq;
    int failed = 0;
    int64_t claimed = 0; /* tasks handed out: each thread claims its next task one ahead */
#pragma omp parallel if (work * hq * d > PAR_MIN_WORK) reduction(| : failed)
    {
        Scratch s = {malloc(sizeof(float) * (lanes * cap + lanes * d + lanes)), NULL, NULL,
                     malloc(sizeof(int64_t) * (cap > 0 ? cap : 1)), malloc(sizeof(int64_t) * (cap > 0 ? cap : 1)), NULL,
                     NULL, NULL};
        if (kv != KV_FLOAT) {
            s.wide = malloc(sizeof(float) * KEY_CHUNK * d);
            s.ks = malloc(sizeof(float) * KEY_CHUNK);
        }
        failed = s.sc == NULL || s.off == NULL || s.next_off == NULL || (kv != KV_FLOAT && (s.wide == NULL || s.ks == NULL));
#if HAVE_AMX
        AmxBuffers amx_buffers = {0};
        if (amx_lanes > 0 && !failed) { /* lanes of one kv head: TILE_ROWS * g, a multiple of 16 */
            const int64_t cap32 = (cap + 31) / 32 * 32, head_lanes = TILE_ROWS * g;
            bf16 *buf = malloc(sizeof(bf16) * (head_lanes * d + 2 * head_lanes * cap32));
            float *ob = malloc(sizeof(float) * 16 * d);
            if (buf == NULL || ob == NULL) {
                free(buf);
                free(ob);
                failed = 1;
            } else {
                amx_buffers = (AmxBuffers){buf, buf + head_lanes * d, ob};
                s.amx = &amx_buffers;
                amx_configure();
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < num_units; u++) {
            int64_t lo = 0, hi = num_packs - 1; /* the pack of unit u: pack_units[lo] <= u < pack_units[lo + 1] */
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (pack_units[mid] <= u) lo = mid;
                else hi = mid - 1;
            }
            const AmxPack *pk = &packs[lo];
            amx_pack_keys(pk, pk->start + 32 * (u - pack_units[lo]), k, v, bt + pk->seq * bt_stride, bs, hkv, d);
        }
#endif
        int64_t task = num_tasks;
        if (!failed) {
            s.acc = s.sc + lanes * cap;
            s.inv = s.acc + lanes * d;
#pragma omp atomic capture
            task = claimed++;
        }
        Fetch ahead = {0}; /* the fetch cursor of `task`'s first chunk */
        if (task < num_tasks) {
            const int64_t h0 = task % tasks_per_tile * heads_per_task;
            ahead = task_fetch(&tiles[task / tasks_per_tile], h0, h0 + heads_per_task, k, v, bt, bt_stride, hkv, bs,
                               width, elsize, s.off);
        }
        while (task < num_tasks) {
            fetch_lines(&ahead, ahead.end * ahead.lines); /* what the task before did not fetch of it */
            int64_t following;
#pragma omp atomic capture
            following = claimed++;
            Fetch next = {0};
            if (following < num_tasks) {
                const int64_t h0 = following % tasks_per_tile * heads_per_task;
                next = task_fetch(&tiles[following / tasks_per_tile], h0, h0 + heads_per_task, k, v, bt, bt_stride,
                                  hkv, bs, width, elsize, s.next_off);
            }
            const Tile *tile = &tiles[task / tasks_per_tile];
            const int64_t h0 = task % tasks_per_tile * heads_per_task, h1 = h0 + heads_per_task;
            if (kv != KV_FLOAT && bf)
                attend_task_8bit_bf16(&call, tile, h0, h1, s, ahead, &next);
            else if (kv != KV_FLOAT)
                attend_task_8bit_fp32(&call, tile, h0, h1, s, ahead, &next);
            else if (bf)
                attend_task_bf16(&call, tile, h0, h1, s, ahead, &next);
            else
                attend_task_fp32(&call, tile, h0, h1, s, ahead, &next);
            int64_t *swap = s.off;
            s.off = s.next_off;
            s.next_off = swap;
            ahead = next;
            task = following;
        }
        free(s.sc);
        free(s.off);
        free(s.next_off);
        free(s.wide);
        free(s.ks);
#if HAVE_AMX
        if (s.amx != NULL) {
            _tile_release();
            free(amx_buffers.qa);
            free(amx_buffers.ob);
        }
#endif
    }
    free(tiles);
    free(packs);
    free(pack_units);
    free(pack_buffer);
    return failed;
no_memory:
    free(tiles);
    free(packs);
    free(pack_units);
    return 1;
}

int paged_attention(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                    int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out, int64_t num_rows,
                    int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf, int64_t amx_lanes,
                    int64_t window, float softcap) {
    return attend_rows(q, q_stride, k, v, bt, bt_stride, row_seq, row_len, out, num_rows, hq, hkv, d, bs, scale, bf,
                       amx_lanes, window, softcap, KV_FLOAT);
}

/* ---- KV store --------------------------------------------------------------------------------------- */

/* Copy each token's K and V rows (width elements of elsize bytes, `stride` apart) into slot slots[i]; < 0 skipped. */
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

/* ---- the int8 KV pool (kv_cache_dtype: int8) ---------------------------------------------------------- */

/* One int8 row (Q8_ROW): the same bytes as layouts/kv_rows.py's quantize_rows. */

static void quantize_row(const void *x, int64_t d, int8_t *dst, const int bf) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        const float a = fabsf(ld1(x, i, bf));
        absmax = a > absmax ? a : absmax;
    }
    const float scale = absmax * (1.0f / 127.0f); /* the product, as kv_rows.quantize_rows (torch on CUDA) */
    for (int64_t i = 0; i < d; i++) {
        float r = scale > 0.0f ? nearbyintf(ld1(x, i, bf) / scale) : 0.0f;
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        dst[i] = (int8_t)r;
    }
    memcpy(dst + d, &scale, 4);
}

/* Quantize each token's K and V rows (hkv heads of d values, `stride` apart) into int8 slot slots[i]; < 0 skipped. */
void store_kv_int8(const void *k, const void *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
                   int64_t hkv, int64_t d, void *kc, void *vc, int bf) {
#pragma omp parallel for if (num_tokens * hkv * d > PAR_MIN_WORK)
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        for (int64_t h = 0; h < hkv; h++) {
            const int64_t dst = (slots[i] * hkv + h) * Q8_ROW(d);
            quantize_row(at(k, i * stride + h * d, bf), d, (int8_t *)kc + dst, bf);
            quantize_row(at(v, i * stride + h * d, bf), d, (int8_t *)vc + dst, bf);
        }
    }
}

/* paged_attention's contract over an int8 pool (attend_tile_8bit). */
int paged_attention_int8(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                         int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out,
                         int64_t num_rows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf,
                         int64_t window, float softcap) {
    return attend_rows(q, q_stride, k, v, bt, bt_stride, row_seq, row_len, out, num_rows, hq, hkv, d, bs, scale, bf, 0,
                       window, softcap, KV_INT8);
}

/* x as an fp8 byte (e5m2: 0 e4m3fn, 1 e5m2): clamped to the format's finite range, then rounded to the nearest
 * value, ties to even; NaN stays NaN. The bytes of kv_rows.py's to_fp8 (a clamp, then torch's cast). */
static uint8_t fp8_byte(float x, const int e5m2) {
    const int m = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7, shift = 23 - m;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (x != x) return sign | 0x7fu;
    float a = fabsf(x);
    const float top = e5m2 ? 57344.0f : 448.0f;
    if (a > top) a = top;
    if (a < ldexpf(1.0f, 1 - bias)) /* a subnormal (or zero): a multiple of 2^(1 - bias - m) */
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.0f, bias - 1 + m));
    memcpy(&u, &a, sizeof u);
    u += (1u << (shift - 1)) - 1u + ((u >> shift) & 1u); /* round the mantissa to m bits, ties to even */
    return sign | (uint8_t)((u >> shift) - ((uint32_t)(127 - bias) << m));
}

/* Each token's K and V rows (width values, `stride` apart) as fp8 bytes into slot slots[i]; < 0 skipped. */
void store_kv_fp8(const void *k, const void *v, int64_t stride, const int64_t *slots, int64_t num_tokens,
                  int64_t width, void *kc, void *vc, int bf, int e5m2) {
#pragma omp parallel for if (num_tokens * width > PAR_MIN_WORK)
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] < 0) continue;
        uint8_t *kd = (uint8_t *)kc + slots[i] * width, *vd = (uint8_t *)vc + slots[i] * width;
        for (int64_t j = 0; j < width; j++) {
            kd[j] = fp8_byte(ld1(k, i * stride + j, bf), e5m2);
            vd[j] = fp8_byte(ld1(v, i * stride + j, bf), e5m2);
        }
    }
}

/* The same over an fp8 pool (e5m2: 0 e4m3fn, 1 e5m2), rows of d bytes. */
int paged_attention_fp8(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                        int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out,
                        int64_t num_rows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf,
                        int64_t window, float softcap, int e5m2) {
    return attend_rows(q, q_stride, k, v, bt, bt_stride, row_seq, row_len, out, num_rows, hq, hkv, d, bs, scale, bf, 0,
                       window, softcap, e5m2 ? KV_E5M2 : KV_E4M3);
}
