/* CPU kernels for fp32 and bf16 inference: paged attention (decode and prefill rows in one call) and the fused
 * element-wise ops of a decoder layer. On a CPU these ops are bound by memory traffic and by per-op dispatch, not by arithmetic: torch
 * runs an RMSNorm as five passes over the activations and a decode attention as a gather, a copy and
 * SDPA. Each function here makes one pass, reads K/V in place through the block tables, and parallelises
 * with OpenMP. Loaded after torch, the library binds to torch's own OpenMP runtime (the same libgomp.so.1),
 * so it shares torch's thread pool instead of adding threads to it.
 *
 * Plain C99 (no torch headers: it builds in about a second); written so that GCC vectorises the inner
 * loops for whatever -march=native offers. Every kernel takes fp32 or bf16 tensors (a flag, `bf`): bf16
 * values are widened to fp32 on load, all arithmetic and accumulation is fp32, and results are rounded to
 * nearest-even bf16 on store. Each kernel body is one always-inlined function with the flag a constant, so
 * the compiler emits a separate loop for each dtype (but an OpenMP region is outlined before inlining: what
 * runs inside one must be entered through a function per dtype, as paged_attention does, for the flag to be
 * a constant there). On CPUs with AVX512_BF16 (the library is built with
 * -march=native for the CPU it runs on, keyed by its flags) the q.K dot products of bf16 attention use
 * vdpbf16ps and the stores vcvtneps2bf16; elsewhere plain AVX-512 / AVX2 shifts do the same. Layouts:
 *   KV pool of one layer: K [num_blocks, block_size, num_kv_heads, head_dim], V the same.
 *   q / k / v rows: token-major with a row stride (they are views into the fused qkv projection). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
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
#if defined(__AVX512F__) /* one vpmovzxwd (GCC splits the generic conversion into 256-bit halves) */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
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

/* ---- paged attention (decode, prefill and extend rows alike) ----------------------------------------- */

/* Every query row of a step, decode or prefill, is the same problem: one query attends to keys [0, n) of
 * its sequence, read in place through the block table (the step's own K/V are stored before attention, so a
 * prefill token at position p is a decode over keys [0, p]). One kernel does all rows, and the arithmetic of
 * a row is a function of that row alone: its scores, its softmax and its weighted sum of V are always taken
 * key by key in the same order, whatever else the step holds, however the rows are tiled and on whatever
 * thread (issue 14: a row's output never depends on its batch). The context is never split.
 *
 * A task is (tile, kv head): a tile is up to TILE_ROWS consecutive rows of one sequence (the rows of a
 * prefill chunk; a decode row is a tile of one). Its K and V are walked in chunks of KEY_CHUNK keys, and
 * each chunk, while in L1, serves every row of the tile and every query head of the GQA group. The block
 * table is resolved once per tile into row offsets, not per key. */
#define TILE_ROWS 16
#define KEY_CHUNK 64

ALWAYS const void *at(const void *p, int64_t i, const int bf) { return (const char *)p + i * (bf ? 2 : 4); }

/* off[t] = where key t's row starts in the pool (in elements; add h * d for kv head h), for t < n. */
static void key_offsets(const int32_t *table, int64_t n, int64_t bs, int64_t row, int64_t *off) {
    for (int64_t b = 0, t = 0; t < n; b++) {
        const int64_t base = (int64_t)table[b] * bs * row;
        for (int64_t o = 0; o < bs && t < n; o++, t++) off[t] = base + o * row;
    }
}

/* The K and V rows a tile will read next, fetched a cache line at a time as it computes: the rows of a paged
 * context are scattered, so the hardware prefetchers do not follow them, and fetching a chunk's rows all at
 * once stalls on the line fill buffers (the perf profile of a decode step had ~40% of the kernel's time on
 * prefetch instructions so issued) while the chunk's compute waits. The cursor walks keys [key, end) line by
 * line, K's line and V's together. */
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

/* a[j] = the partial sums (one vector) of q.K[j] for the m keys at off[0..m): fp32 FMAs, or vdpbf16ps on bf16
 * pairs (exact products, fp32 sums) when qb is set. Each key fetches one more line of what comes next (f). */
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

/* sc[t] = scale * q.K[t] for t in [t0, t1), t0 a multiple of VW. A key's score depends on q and K[t] only:
 * with sums16 each lane of the result is the tree sum of its own key's partial sums, so which keys share
 * a group (or sit in a group's padded tail) never changes a score. sc has room up to t1 rounded up to VW. */
ALWAYS void chunk_scores(const void *qj, const void *kh, const int64_t *off, int64_t t0, int64_t t1, Fetch *f,
                         float *sc, const int64_t d, float scale, const int bf) {
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

/* x[t] = exp(x[t] - max x) in place for t < n (n >= 1); returns their sum, taken in a fixed order. */
static float softmax_numerators(float *x, int64_t n) {
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
        const vf e = exp_v(vload(x + t) - m);
        vstore(x + t, e);
        acc += e;
    }
    if (t < n) exp_tail(x + t, x + t, n - t, m);
    for (; t < n; t++) sum += x[t];
    return sum + hsum(acc);
}

/* acc[h] += sum_{t in [t0, t1)} p[h][t] V[t] for nh heads (p rows `cap` apart, acc rows d apart), key by
 * key in order. With d and nh constants the accumulators and the V row live in registers; one V row load
 * serves the nh heads. */
/* Whether chunk_pv keeps a row's accumulators with the dims permuted: bf16 V rows are widened by interleaving
 * with zeros (vpunpck{l,h}wd: two instructions per 32 values instead of four), which leaves dims
 * {0-3, 8-11, 16-19, 24-27} of each 32 in the first vector and the others in the second. Only the lanes move:
 * each dim's sum is the same. `unpermute` puts them back when the row is written out. */
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

/* The g heads of one row's GQA group, in register-sized runs of heads (a run's heads are independent:
 * the split never changes a head's sums). */
ALWAYS void group_pv(const float *p, int64_t cap, const void *vh, const int64_t *off, int64_t t0, int64_t t1,
                     float *acc, Fetch *f, int64_t g, const int64_t d, const int bf) {
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
} Tile;

static int by_cost_descending(const void *a, const void *b) {
    const int64_t x = ((const Tile *)a)->cost, y = ((const Tile *)b)->cost;
    return (x < y) - (x > y);
}

/* Scratch of one thread: scores [TILE_ROWS * g][cap], accumulators [TILE_ROWS * g][d], sums, the key offsets
 * of its task and of its next one. */
typedef struct {
    float *sc, *acc, *inv;
    int64_t *off, *next_off;
} Scratch;

/* The fetch cursor of a task's keys, its first chunk to come, with the task's key offsets written to off. */
static Fetch task_fetch(const Tile *tile, int64_t h0, int64_t h1, const void *k, const void *v, const int32_t *bt,
                        int64_t bt_stride, int64_t row, int64_t bs, int64_t d, int64_t *off, const int bf) {
    key_offsets(bt + tile->seq * bt_stride, tile->max_len, bs, row, off);
    const int64_t width = (h1 - h0) * d * (bf ? 2 : 4); /* bytes of a key's K (or V) row the task reads */
    const Fetch f = {at(k, h0 * d, bf), at(v, h0 * d, bf), off, 0, KEY_CHUNK < tile->max_len ? KEY_CHUNK : tile->max_len,
                     0, (width + 63) / 64, bf ? 2 : 4};
    return f;
}

/* Rows [first, first + rows) of one sequence, kv heads [h0, h1), its key offsets in s.off and `f` its fetch
 * cursor, past the first chunk. Scratch lanes are (row, query head). Each chunk fetches the next one's rows as
 * it computes, and the last one and the weighted sums of V fetch the first chunk of the thread's next task
 * (`next`). */
ALWAYS void attend_tile(const Tile *tile, int64_t h0, int64_t h1, const void *q, int64_t q_stride, const void *k,
                        const void *v, const int32_t *row_len, void *out, int64_t hq, int64_t g, int64_t cap,
                        float scale, Scratch s, Fetch f, Fetch *next, const int64_t d, const int bf) {
    const int64_t first = tile->first, rows = tile->rows, max_len = tile->max_len;
    for (int64_t c0 = 0; c0 < max_len; c0 += KEY_CHUNK) {
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
        const int64_t n = row_len[first + r];
        for (int64_t j = h0 * g; j < h1 * g; j++) {
            s.inv[r * hq + j] = n > 0 ? 1.0f / softmax_numerators(s.sc + (r * hq + j) * cap, n) : 0.0f;
            memset(s.acc + (r * hq + j) * d, 0, sizeof(float) * d);
        }
    }
    for (int64_t c0 = 0; c0 < max_len; c0 += KEY_CHUNK) {
        for (int64_t h = h0; h < h1; h++) {
            const void *vh = at(v, h * d, bf);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t n = row_len[first + r], t1 = c0 + KEY_CHUNK < n ? c0 + KEY_CHUNK : n;
                const int64_t lane = r * hq + h * g;
                if (n > c0) group_pv(s.sc + lane * cap, cap, vh, s.off, c0, t1, s.acc + lane * d, next, g, d, bf);
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

/* The arguments every task of one call shares. */
typedef struct {
    const void *q, *k, *v;
    const int32_t *row_len;
    void *out;
    int64_t q_stride, hq, g, cap, d;
    float scale;
} AttentionCall;

/* One task with the dtype a constant. The OpenMP region is outlined before inlining, so a dtype flag
 * passed through it would stay a run-time value in the hot loops; these two functions fix it again. */
ALWAYS void attend_task(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                        Fetch *next, const int bf) {
    if (c->d == 64)
        attend_tile(tile, h0, h1, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale, s,
                    own, next, 64, bf);
    else if (c->d == 128)
        attend_tile(tile, h0, h1, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale, s,
                    own, next, 128, bf);
    else
        attend_tile(tile, h0, h1, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale, s,
                    own, next, c->d, bf);
}
static void attend_task_fp32(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                             Fetch *next) {
    attend_task(c, tile, h0, h1, s, own, next, 0);
}
static void attend_task_bf16(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                             Fetch *next) {
    attend_task(c, tile, h0, h1, s, own, next, 1);
}

/* out[i, hq, d] = softmax(scale * q[i] K^T) V over keys [0, row_len[i]) of sequence row_seq[i] (its block
 * table is row row_seq[i] of bt, bt_stride apart), for every query row i < num_rows: decode rows (row_len =
 * the context) and prefill / extend rows (row_len = the row's position + 1) alike. q rows are q_stride
 * elements apart; out is contiguous [num_rows, hq, d]; q, K/V and out are fp32, or bf16 when bf. The rows of
 * one sequence should be consecutive (they then share K/V loads). row_len[i] >= 1 (a row with 0 gets zeros).
 * Returns 0, or 1 if scratch memory could not be allocated (out is then incomplete). */
int paged_attention(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                    int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out, int64_t num_rows,
                    int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf) {
    const int64_t g = hq / hkv;
    Tile *tiles = malloc(sizeof(Tile) * (num_rows > 0 ? num_rows : 1));
    if (tiles == NULL) return 1;
    int64_t num_tiles = 0, cap = 0, work = 0;
    for (int64_t i = 0; i < num_rows;) {
        Tile t = {row_seq[i], i, 0, 0, 0};
        for (; i < num_rows && row_seq[i] == t.seq && t.rows < TILE_ROWS; i++, t.rows++) {
            t.max_len = row_len[i] > t.max_len ? row_len[i] : t.max_len;
            t.cost += row_len[i];
        }
        tiles[num_tiles++] = t;
        cap = t.max_len > cap ? t.max_len : cap;
        work += t.cost;
    }
    /* largest first, so that the dynamic schedule ends on small tasks (the order changes no result) */
    qsort(tiles, num_tiles, sizeof(Tile), by_cost_descending);
    cap = (cap + VW - 1) / VW * VW;
    const AttentionCall call = {q, k, v, row_len, out, q_stride, hq, g, cap, d, scale};
    /* A task covers all kv heads of a tile (its K/V rows are then read whole, in address order, which the
     * hardware prefetchers follow), or one kv head when there are too few tiles to keep the threads busy. */
    const int64_t heads_per_task = num_tiles >= 8 * omp_get_max_threads() ? hkv : 1;
    const int64_t tasks_per_tile = hkv / heads_per_task, num_tasks = num_tiles * tasks_per_tile;
    const int64_t lanes = TILE_ROWS * hq;
    int failed = 0;
    int64_t claimed = 0; /* tasks handed out: a dynamic schedule, each thread claiming its next task one ahead */
#pragma omp parallel if (work * hq * d > PAR_MIN_WORK) reduction(| : failed)
    {
        Scratch s = {malloc(sizeof(float) * (lanes * cap + lanes * d + lanes)), NULL, NULL,
                     malloc(sizeof(int64_t) * (cap > 0 ? cap : 1)), malloc(sizeof(int64_t) * (cap > 0 ? cap : 1))};
        failed = s.sc == NULL || s.off == NULL || s.next_off == NULL;
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
            ahead = task_fetch(&tiles[task / tasks_per_tile], h0, h0 + heads_per_task, k, v, bt, bt_stride, hkv * d, bs,
                               d, s.off, bf);
        }
        while (task < num_tasks) {
            fetch_lines(&ahead, ahead.end * ahead.lines); /* what the task before did not fetch of its first chunk */
            int64_t following;
#pragma omp atomic capture
            following = claimed++;
            Fetch next = {0};
            if (following < num_tasks) {
                const int64_t h0 = following % tasks_per_tile * heads_per_task;
                next = task_fetch(&tiles[following / tasks_per_tile], h0, h0 + heads_per_task, k, v, bt, bt_stride,
                                  hkv * d, bs, d, s.next_off, bf);
            }
            const Tile *tile = &tiles[task / tasks_per_tile];
            const int64_t h0 = task % tasks_per_tile * heads_per_task, h1 = h0 + heads_per_task;
            if (bf)
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
    }
    free(tiles);
    return failed;
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

/* This thread's share [r0, r1) of `rows` rows, contiguous (OpenMP's static schedule). */
static void thread_rows(int64_t rows, int64_t *r0, int64_t *r1) {
    const int64_t n = omp_get_num_threads(), i = omp_get_thread_num(), per = rows / n, extra = rows % n;
    *r0 = i * per + (i < extra ? i : extra);
    *r1 = *r0 + per + (i < extra);
}

/* impl(args..., 1) when bf, else impl(args..., 0), for an always-inlined per-dtype body. Used inside the
 * parallel regions below: an OpenMP region is outlined before inlining, so a dtype flag passed into it stays a
 * run-time value; called from inside with the flag a literal, each branch inlines its own copy of the body with
 * the dtype a constant in its loops (what attend_task_fp32 / attend_task_bf16 do for paged_attention). */
#define BY_DTYPE(bf, impl, ...) do { if (bf) impl(__VA_ARGS__, 1); else impl(__VA_ARGS__, 0); } while (0)

/* out = weight * rmsnorm(h), with h = x + residual written back to residual when add is set (the
 * residual stream of the next op), else h = x. Rows of `dim` contiguous elements. In bf16 the
 * intermediate roundings are torch's (and transformers'): h is stored in bf16 and the norm is taken of
 * the stored h, the normalised row is rounded to bf16 before the weight multiplies it. With res_fp32 (bf16
 * models on a CPU, ops.py) the residual stream is fp32 instead: h is kept unrounded, and only the norm's
 * output is bf16. */
ALWAYS void rms_norm_impl(const void *x, void *residual, const void *weight, void *out, int64_t r0, int64_t r1,
                          int64_t dim, float eps, int add, const int res_fp32, const int bf) {
    const int hb = bf && !res_fp32; /* h's storage dtype */
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = at(x, r * dim, bf);
        void *hr = add ? (void *)at(residual, r * dim, hb) : (void *)xr, *orow = (void *)at(out, r * dim, bf);
        const int hl = add ? hb : bf; /* the dtype h is read back in */
        float ss = 0.0f;
        int64_t i = 0;
        vf acc = {0};
        if (add) {
            for (; i + VW <= dim; i += VW) {
                const vf h = rnd(ldv(hr, i, hb) + ldv(xr, i, bf), hb);
                stv(hr, i, h, hb);
                acc += h * h;
            }
            for (; i < dim; i++) {
                const float h = rnd1(ld1(hr, i, hb) + ld1(xr, i, bf), hb);
                st1(hr, i, h, hb);
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
        for (i = 0; i + VW <= dim; i += VW) stv(orow, i, ldv(weight, i, bf) * rnd(ldv(hr, i, hl) * inv, bf), bf);
        for (; i < dim; i++) st1(orow, i, ld1(weight, i, bf) * rnd1(ld1(hr, i, hl) * inv, bf), bf);
    }
}
ALWAYS void rms_norm_res(const void *x, void *residual, const void *weight, void *out, int64_t r0, int64_t r1,
                         int64_t dim, float eps, int add, int res_fp32, const int bf) {
    if (res_fp32)
        rms_norm_impl(x, residual, weight, out, r0, r1, dim, eps, add, 1, bf);
    else
        rms_norm_impl(x, residual, weight, out, r0, r1, dim, eps, add, 0, bf);
}

void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim, float eps,
              int add, int res_fp32, int bf) {
#pragma omp parallel if (rows * dim > PAR_MIN_WORK)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        BY_DTYPE(bf, rms_norm_res, x, residual, weight, out, r0, r1, dim, eps, add, res_fp32);
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the gate and up halves of the fused projection. In bf16,
 * silu's result is rounded before the product, as torch's two ops do. */
ALWAYS void silu_mul_impl(const void *gu, void *out, int64_t r0, int64_t r1, int64_t inter, const int bf) {
    for (int64_t r = r0; r < r1; r++) {
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
#pragma omp parallel if (rows * inter > PAR_MIN_WORK)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        BY_DTYPE(bf, silu_mul_impl, gu, out, r0, r1, inter);
    }
}

/* Rotary embedding in place on the first `heads` heads of each row (the q and k heads of the fused qkv
 * projection): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves of each head, with the
 * cos/sin rows of the token's position (fp32 tables [max_pos, d], both halves equal, as transformers
 * builds). Rows are `stride` elements apart; in bf16 the rotation is computed in fp32 and rounded once. */
ALWAYS void rope_impl(void *x, int64_t stride, int64_t r0, int64_t r1, int64_t heads, int64_t d, const int64_t *positions,
                      const float *cos_t, const float *sin_t, const int bf) {
    const int64_t half = d / 2;
    for (int64_t r = r0; r < r1; r++) {
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
#pragma omp parallel if (rows * heads * d > PAR_MIN_WORK)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        BY_DTYPE(bf, rope_impl, x, stride, r0, r1, heads, d, positions, cos_t, sin_t);
    }
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

/* ---- linears on weights packed once into column panels: fp32, and bf16 for a few rows ----------------
 * y = x W^T + bias. Every output is one fused multiply-add chain over k = 0 .. K-1, started at zero, plus the
 * bias at the end: the same operations in the same order whatever the row count, the rows beside it or the
 * thread that runs it. So a row's product is bit for bit independent of its batch (EngineArgs.batch_invariant)
 * by construction, at every row count including 1, with no padding or tiling rules. The kernel is a plain
 * register-blocked outer product (PANEL_ROWS rows x PANEL_WIDTH columns of fp32 accumulators, the weights'
 * panel streamed with a software prefetch PANEL_PREFETCH k-steps ahead and the next panel fetched into L2
 * meanwhile): a decode step of a few rows reads the weights from memory, and the prefetch keeps that stream
 * near the memory bandwidth, where oneDNN's fp32 kernels take 1.25-1.55x its time at 8 rows (figures in
 * cpu_linear.py's docstring, which also says which models use it). Threads split the panels, so each weight
 * byte is read once per chunk of rows; the rows go in chunks whose activations stay in L2.
 *
 * bf16 weights (linear_bf16_small) go through the same kernel, widened to fp32 as they are loaded (a shift):
 * bf16 x bf16 products are exact in fp32, and the sums are fp32, as in oneDNN's bf16 kernels. It serves the
 * few-row calls of a bf16 decode step, where oneDNN's AMX kernels read the weights at about half the memory
 * bandwidth (cpu_kernels.SMALL_ROWS says up to which row count it wins). The bf16 rows of x are widened once
 * per call into a scratch buffer. */
#define PANEL_ROWS 8
#define PANEL_VECS 3
#define PANEL_WIDTH (16 * PANEL_VECS)
#define PANEL_PREFETCH 32
#define PANEL_CHUNK_BYTES (1024 * 1024)
#define PANEL_FETCHERS 8 /* the most row tiles of a panel that share fetching the next one */

/* The outputs per panel of pack_linear's layout, or 0 where the panel linears do not run (no AVX-512). */
int f32_linear_panel(void) {
#if defined(__AVX512F__)
    return PANEL_WIDTH;
#else
    return 0;
#endif
}

/* packed[p][i][j] = w[PANEL_WIDTH p + j][i] (0 past n): ceil(n / PANEL_WIDTH) panels of k x PANEL_WIDTH, of
 * elements of `es` bytes (4: fp32, 2: bf16). */
static void pack_linear(const void *w, int64_t n, int64_t k, void *packed, const int64_t es) {
    const int64_t panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < PANEL_WIDTH; j++) {
                const int64_t row = p * PANEL_WIDTH + j;
                char *dst = (char *)packed + ((p * k + i) * PANEL_WIDTH + j) * es;
                if (row < n)
                    memcpy(dst, (const char *)w + (row * k + i) * es, es);
                else
                    memset(dst, 0, es);
            }
}
void pack_f32_linear(const float *w, int64_t n, int64_t k, float *packed) { pack_linear(w, n, k, packed, 4); }
void pack_bf16_linear(const bf16 *w, int64_t n, int64_t k, bf16 *packed) { pack_linear(w, n, k, packed, 2); }

#if defined(__AVX512F__)
/* rows x width outputs at y (row stride ldy) from fp32 rows of x (stride ldx) and one packed panel of fp32
 * (bf = 0) or bf16 (bf = 1) weights; y and bias in the weights' dtype. `next`, if not NULL, is the panel after
 * it, fetched into L2 meanwhile (the first row tile of a panel would otherwise wait on memory for its weights):
 * this tile, number `tile` of the `tiles` that share it (the panel's first PANEL_FETCHERS), fetches its part,
 * so that the memory stream goes on while the later tiles compute from cache (fetched by the first tile alone, a 16-row call took the time of
 * the stream plus that of the second tile's compute). */
ALWAYS void panel_tile(const int rows, const float *x, int64_t ldx, const void *panel, int64_t k, void *y,
                       int64_t ldy, int64_t width, const void *bias, const void *next, int64_t tile, int64_t tiles,
                       const int bf) {
    const int64_t step = PANEL_WIDTH * (bf ? 2 : 4); /* bytes of one k-step of a panel: 192 or 96 */
    const char *pw = panel, *pn = next;
    /* k-step i of this tile fetches row fetch_row of the next panel when i == fetch_at: rows at even steps
     * over the panel's tiles x k steps */
    int64_t fetch_row = (tile * k + tiles - 1) / tiles, fetch_at = fetch_row * tiles - tile * k;
    __m512 acc[PANEL_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int64_t i = 0; i < k; i++) {
        __m512 w[PANEL_VECS];
        for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pw + (i + PANEL_PREFETCH) * step + b, _MM_HINT_T0);
        for (int q = 0; q < PANEL_VECS; q++)
            w[q] = bf ? (__m512)vload_bf16((const bf16 *)(pw + i * step) + 16 * q)
                      : _mm512_loadu_ps((const float *)(pw + i * step) + 16 * q);
        if (pn != NULL && i == fetch_at) {
            for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pn + fetch_row * step + b, _MM_HINT_T1);
            fetch_row++;
            fetch_at += tiles;
        }
        for (int r = 0; r < rows; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);
            for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = _mm512_fmadd_ps(xv, w[q], acc[r][q]);
        }
    }
    for (int q = 0; q < PANEL_VECS; q++) {
        const int64_t left = width - 16 * q;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        if (!bf) {
            const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, (const float *)bias + 16 * q) : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++)
                _mm512_mask_storeu_ps((float *)y + r * ldy + 16 * q, mask, _mm512_add_ps(acc[r][q], b));
            continue;
        }
        bf16 tmp[16] = {0};
        if (bias != NULL) memcpy(tmp, (const bf16 *)bias + 16 * q, 2 * (left < 16 ? left : 16));
        const vf b = bias != NULL ? vload_bf16(tmp) : (vf){0};
        for (int r = 0; r < rows; r++) {
            bf16 *dst = (bf16 *)y + r * ldy + 16 * q;
            if (left >= 16) {
                vstore_bf16(dst, (vf)acc[r][q] + b);
            } else {
                vstore_bf16(tmp, (vf)acc[r][q] + b);
                memcpy(dst, tmp, 2 * left);
            }
        }
    }
}
#define PANEL_TILE(R) \
    case R: \
        panel_tile(R, x + i * ldx, ldx, panel, k, (char *)y + (i * n + col) * es, n, width, b, \
                   (i - m0) / PANEL_ROWS < fetchers ? next : NULL, (i - m0) / PANEL_ROWS, fetchers, bf); \
        break;

/* y [rows, n] (contiguous) = x [rows, k] (fp32, row stride ldx) W^T + bias, W packed by pack_linear. */
ALWAYS void linear_panels(const float *x, int64_t ldx, int64_t rows, const void *packed, int64_t n, int64_t k,
                          const void *bias, void *y, const int bf) {
    const int64_t es = bf ? 2 : 4;
    const int64_t panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    int64_t chunk = PANEL_CHUNK_BYTES / (4 * k) / PANEL_ROWS * PANEL_ROWS;
    if (chunk < PANEL_ROWS) chunk = PANEL_ROWS;
    const int64_t chunks = (rows + chunk - 1) / chunk; /* equal chunks: 256 rows are not 224 + 32 */
    chunk = ((rows + chunks - 1) / chunks + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
#pragma omp parallel if (n * k > PAR_MIN_WORK)
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t end = m0 + chunk < rows ? m0 + chunk : rows;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const char *panel = (const char *)packed + p * k * PANEL_WIDTH * es;
            const int64_t col = p * PANEL_WIDTH, width = n - col < PANEL_WIDTH ? n - col : PANEL_WIDTH;
            const void *b = bias != NULL ? (const char *)bias + col * es : NULL;
            const void *next = p + 1 < panels ? panel + k * PANEL_WIDTH * es : NULL;
            const int64_t tiles = (end - m0 + PANEL_ROWS - 1) / PANEL_ROWS;
            const int64_t fetchers = tiles < PANEL_FETCHERS ? tiles : PANEL_FETCHERS; /* tiles that fetch `next` */
            for (int64_t i = m0; i < end; i += PANEL_ROWS) {
                switch (end - i < PANEL_ROWS ? end - i : PANEL_ROWS) {
                    PANEL_TILE(1) PANEL_TILE(2) PANEL_TILE(3) PANEL_TILE(4) PANEL_TILE(5) PANEL_TILE(6) PANEL_TILE(7)
                    PANEL_TILE(8)
                    default: break;
                }
            }
        }
    }
}
#endif

/* y [rows, n] (contiguous) = x [rows, k] (row stride ldx) W^T + bias; W packed by pack_f32_linear; bias NULL
 * or [n]. A no-op where f32_linear_panel() is 0, or for 0 rows. */
void linear_f32(const float *x, int64_t ldx, int64_t rows, const float *packed, int64_t n, int64_t k,
                const float *bias, float *y) {
#if defined(__AVX512F__)
    if (rows > 0) linear_panels(x, ldx, rows, packed, n, k, bias, y, 0);
#else
    (void)x, (void)ldx, (void)rows, (void)packed, (void)n, (void)k, (void)bias, (void)y;
#endif
}

/* The same for bf16: x [rows, k] bf16 (rows contiguous), W packed by pack_bf16_linear, bias NULL or [n] bf16,
 * y [rows, n] bf16. Returns 0, or 1 if the widened copy of x could not be allocated (y is then not written). */
int linear_bf16_small(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k, const bf16 *bias,
                      bf16 *y) {
#if defined(__AVX512F__)
    if (rows <= 0) return 0;
    float *xf = malloc(sizeof(float) * rows * k);
    if (xf == NULL) return 1;
    int64_t i = 0;
    for (; i + VW <= rows * k; i += VW) vstore(xf + i, vload_bf16(x + i));
    for (; i < rows * k; i++) xf[i] = bf16_to_f(x[i]);
    linear_panels(xf, k, rows, packed, n, k, bias, y, 1);
    free(xf);
#else
    (void)x, (void)rows, (void)packed, (void)n, (void)k, (void)bias, (void)y;
#endif
    return 0;
}
