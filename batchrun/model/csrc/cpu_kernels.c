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
 * vdpbf16ps and the stores vcvtneps2bf16; elsewhere plain AVX-512 / AVX2 shifts do the same. On CPUs with AMX,
 * bf16 attention and the bf16 linears of up to AMX_SMALL_ROWS rows run on AMX tiles (amx_attend_head,
 * amx_panel). Layouts:
 *   KV pool of one layer: K [num_blocks, block_size, num_kv_heads, head_dim], V the same.
 *   q / k / v rows: token-major with a row stride (they are views into the fused qkv projection). */
#define _GNU_SOURCE /* syscall() */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* CPUs with AVX2 and FMA but not AVX-512 (e.g. AMD Zen 2 / 3): the attention's dot products and weighted sums
 * of V take 8-float paths written for their 16 registers (see chunk_scores8); the 16-float vectors below
 * would take two registers each there, and the 16-key score tree would not fit. */
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
#include <sys/syscall.h>
#include <unistd.h>
/* Linux hands out AMX's tile state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
 * oneDNN asks too, and asking again is harmless. BATCHRUN_AMX=0 keeps the kernels off AMX (the AVX-512 paths,
 * as on a CPU without it). First asked outside any parallel region (packing a linear, or paged_attention). */
static int amx_allowed(void) {
    static int state = 0; /* 1 granted, -1 refused or turned off */
    if (state == 0) {
        const char *env = getenv("BATCHRUN_AMX");
        state = (env == NULL || strcmp(env, "0") != 0) && syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    }
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* tmm0-6, each 16 rows x 64 bytes: what amx_panel (C tiles 0-2, A 3, B 4-6) and amx_attend_head (scores: C 0,
 * A 1, B 2; p.V: C 0-3, A 4 and 6, B 5) use. */
static void amx_configure(void) {
    TileConfig c = {0};
    c.palette = 1;
    for (int t = 0; t < 7; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}
#else
#define HAVE_AMX 0
#endif

#define PAR_MIN_WORK 32768 /* below this many floats an op runs on one thread: waking the pool costs more */

/* Explicit vectors of VW floats (GCC/Clang vector extensions): 16 on AVX-512, 8 elsewhere, one register each.
 * GCC does not vectorise a scalar exp written with a float/int bit cast, so exp is written on vectors directly.
 * (16-float vectors on AVX2 were split into scalar compares and divides in exp_v: silu_mul took 2.9 ns an
 * element.) */
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

/* bf16 <-> fp32: a bf16 is the top half of an fp32, so widening is a shift; narrowing rounds to nearest
 * even (NaNs are not special-cased: the models' activations are finite). */
ALWAYS vf vload_bf16(const bf16 *p) {
#if defined(__AVX512F__) /* one vpmovzxwd (GCC splits the generic conversion into 256-bit halves) */
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
ALWAYS vf vsplat(float x) { return (vf){0} + x; }
ALWAYS vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
ALWAYS float hsum(vf v) {
#if (defined(__clang__) || __GNUC__ >= 12) && VW == 16 /* __builtin_shufflevector: a log-depth tree of lane swaps */
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

#if (defined(__clang__) || __GNUC__ >= 12) && VW == 16
#define HAVE_SHUFFLE 1
/* sums16(a)[j] = hsum(a[j]) for 16 vectors: a tree of 15 shuffle-and-add pairs instead of 16 separate
 * horizontal sums (64 shuffles and adds), the cost that dominates a decode dot product of 64 dims. Each
 * level halves the partial sums per token and doubles the tokens per vector, in order. */
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

/* exp(x), within 2 ulp of expf for x in [-87, 88] (Cephes' single-precision method: range reduction by
 * ln 2 and a degree-6 polynomial); x is clamped to that range, so exp(-inf) gives ~1e-38, not 0. */
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

/* exp of up to VW floats (a loop tail): padded through a vector. */
static inline void exp_tail(const float *x, float *out, int64_t k, float shift, float scale) {
    float buf[VW] = {0};
    memcpy(buf, x, sizeof(float) * k);
    const vf e = exp_v((vload(buf) - shift) * scale);
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

#if HAVE_AVX2_ATTENTION
/* 8 fp32 (bf = 0) or bf16 (bf = 1) values from element i of p, as fp32. */
ALWAYS __m256 ld8(const void *p, int64_t i, const int bf) {
    if (bf)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* Lane j = the sum of a[j]'s 8 lanes, taken as ((0+1)+(2+3)) + ((4+5)+(6+7)) for every j: which vectors share
 * the call never changes a lane's sum (the 8-lane counterpart of sums16). */
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

/* chunk_scores for d a multiple of 8, up to 128, in groups of 8 keys: q's vectors (8 registers at d = 64) and
 * the group's 8 partial sums fill AVX2's 16 registers, and K's loads go straight into the multiply-adds. */
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

/* chunk_pv for d a multiple of 8 and nh <= 3 heads, a slab of 32 dims at a time: the nh x 4 accumulators and
 * a weight fit the 16 registers (V's vectors are loaded again for each head, from L1: holding them too spilled
 * an accumulator). Each dim's sum is the same multiply-add chain over the keys in order as chunk_pv's. */
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

/* sc[t] = scale * q.K[t] for t in [t0, t1), t0 a multiple of VW. A key's score depends on q and K[t] only:
 * with sums16 each lane of the result is the tree sum of its own key's partial sums, so which keys share
 * a group (or sit in a group's padded tail) never changes a score. sc has room up to t1 rounded up to VW. */
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
/* exp_v on 8 lanes (the same range reduction and polynomial), for softmax_numerators8. */
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

/* softmax_numerators on 8 lanes: the 16-float vectors' exp spills AVX2's registers to the stack. */
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

/* x[t] = exp(scale * (x[t] - max x)) in place for t < n (n >= 1); returns their sum, taken in a fixed order.
 * (Scores come scaled, scale 1, except from amx_attend_head.) */
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
    void *amx; /* amx_attend_head's buffers (AMX_ATTENTION only) */
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
            s.inv[r * hq + j] = n > 0 ? 1.0f / softmax_numerators(s.sc + (r * hq + j) * cap, n, 1.0f) : 0.0f;
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

#if HAVE_AMX
/* bf16 attention on AMX tiles, where head_dim is a multiple of 32 (which tiles come here: see the end of this
 * comment). The vector kernel above spends two thirds of its
 * time reducing each (query, key) dot product across a vector, and as much again on p.V multiply-adds; here a
 * (row, query head) lane of a kv head's GQA group is a row of a 16-lane tile, and one tile product gives 16 lanes
 * x 16 keys of scores over 32 dims, or 16 lanes x 16 dims of p.V over 32 keys:
 *   scores: A = the lanes' queries (16 x 32 dims), B = 16 keys' K with their pairs of dims key-interleaved
 *           (vdpbf16ps's pair layout; a 16 x 16 transpose of K's 32-bit pairs per key group and kv head);
 *   softmax: over each lane's keys [0, n), in fp32, as the vector kernel's (softmax_numerators);
 *   p.V:    A = the lanes' p (16 x 32 keys, zero past n) as two bf16 terms, p's rounding and the rest (so that
 *           p keeps 16 bits: rounded to bf16 alone, the outputs drifted past 1.5 bf16 ulps of the fp32
 *           reference in tests/test_cpu_attention.py), B = V with pairs of keys interleaved.
 * Each lane's sums are chains of tile products over 32 dims, then 32 keys, in order from key 0: a function of
 * the lane's own query, keys and values, whatever rows share the tiles (keys past a row's length add p = 0 exactly),
 * so a row's output does not depend on its batch here either. The sums and the softmax are fp32.
 * A tile of few lanes (a decode row: g lanes, or 2g with a draft) leaves most of each tile product unused and
 * still pays K's transposes: in `python -m benchmarks.phases` (bf16 SmolLM2, no drafts), a decode step of 64
 * sequences took 60.9-61.8 ms with every row on AMX against 51.4-56.3 ms on the vector kernel, while prefill
 * rows ran 1.7-2.2x the vector kernel's speed (benchmarks.kernels). So outside the batch-invariant mode only
 * tiles of at least 16 lanes (prefill chunks) come here (paged_attention's amx_lanes). */
#define AMX_ATTENTION(d, bf) ((bf) && (d) % 32 == 0 && (d) <= 512 && amx_allowed())

typedef struct {
    bf16 *qa, *kt, *pb, *vb; /* lanes' queries [lanes][d]; one key group's K [d / 2][16][2]; p's two terms
                                [2][lanes][cap32]; V [cap32 / 2][d][2] */
    float *ob;               /* one lane tile's p.V sums [16][d] */
} AmxBuffers;

/* The lanes x key-pair layout of 16 keys' K: rows[i] holds key i's pairs (32-bit) [16c, 16c + 16); out row j
 * gets pair 16c + j of the 16 keys. */
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

/* One kv head h of a tile: lanes (r, j) for r < rows, j < g, lane r * g + j. sc: [16 * g][cap] fp32 scores,
 * inv: the lanes' 1 / sums. `f` fetches the task's K/V ahead, `next` the next task's first chunk. */
static void amx_attend_head(const Tile *tile, int64_t h, const bf16 *q, int64_t q_stride, const bf16 *k,
                            const bf16 *v, const int32_t *row_len, bf16 *out, int64_t hq, int64_t g, int64_t cap,
                            float scale, const int64_t *off, float *sc, float *inv, AmxBuffers b,
                            Fetch *f, Fetch *next, int64_t d) {
    const int64_t first = tile->first, rows = tile->rows, max_len = tile->max_len, lanes = rows * g;
    const int64_t lane_tiles = (lanes + 15) / 16, cap32 = (cap + 31) / 32 * 32, key_chunks = (max_len + 31) / 32;
    /* (the padding lanes of the last lane tile keep whatever they hold: their sums are never read) */
    for (int64_t l = 0; l < lanes; l++) memcpy(b.qa + l * d, q + (first + l / g) * q_stride + (h * g + l % g) * d, 2 * d);
    /* scores */
    for (int64_t t0 = 0; t0 < max_len; t0 += 16) {
        const int64_t m = max_len - t0 < 16 ? max_len - t0 : 16; /* keys past the tile's are zeros */
        for (int64_t c = 0; c < d / 32; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                if (c == 0) fetch_lines(f, f->lines); /* a key's lines at a time: a burst stalls on the fill buffers */
                r[i] = i < m ? _mm512_loadu_si512(k + off[t0 + i] + h * d + 32 * c) : _mm512_setzero_si512();
            }
            transpose16x16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(b.kt + (16 * c + i) * 32, r[i]);
        }
        for (int64_t mt = 0; mt < lane_tiles; mt++) {
            _tile_zero(0);
            for (int64_t c = 0; c < d / 32; c++) {
                _tile_loadd(1, b.qa + mt * 16 * d + 32 * c, d * 2);
                _tile_loadd(2, b.kt + c * 16 * 32, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, sc + mt * 16 * cap + t0, cap * 4);
        }
    }
    /* softmax, and p in bf16 (zero past each lane's keys) */
    for (int64_t l = 0; l < lanes; l++) {
        const int64_t n = row_len[first + l / g];
        float *x = sc + l * cap;
        inv[l] = n > 0 ? 1.0f / softmax_numerators(x, n, scale) : 0.0f;
        for (int64_t t = 0; t < key_chunks * 32; t += 16) {
            const int64_t m = n - t < 0 ? 0 : n - t < 16 ? n - t : 16;
            const vf p = m > 0 ? (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), x + t) : (vf){0};
            vstore_bf16(b.pb + l * cap32 + t, p);
            vstore_bf16(b.pb + (lane_tiles * 16 + l) * cap32 + t, p - vload_bf16(b.pb + l * cap32 + t));
        }
    }
    /* V with pairs of keys interleaved (zero past the tile's keys) */
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t t = 0; t < key_chunks * 32; t += 2) {
        fetch_lines(next, 1);
        bf16 *dst = b.vb + t * d;
        const bf16 *v0 = t < max_len ? v + off[t] + h * d : NULL, *v1 = t + 1 < max_len ? v + off[t + 1] + h * d : NULL;
        for (int64_t e = 0; e < d; e += 32) {
            const __m512i a = v0 != NULL ? _mm512_loadu_si512(v0 + e) : _mm512_setzero_si512();
            const __m512i c = v1 != NULL ? _mm512_loadu_si512(v1 + e) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * e, _mm512_permutex2var_epi16(a, lo, c));
            _mm512_storeu_si512(dst + 2 * e + 32, _mm512_permutex2var_epi16(a, hi, c));
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
            for (int64_t kc = 0; kc < key_chunks; kc++) {
                const bf16 *vbc = b.vb + kc * 32 * d + 2 * e0; /* pair rows d * 4 bytes apart */
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

/* The arguments every task of one call shares. */
typedef struct {
    const void *q, *k, *v;
    const int32_t *row_len;
    void *out;
    int64_t q_stride, hq, g, cap, d;
    float scale;
    int64_t amx_lanes; /* the fewest lanes (rows x query heads of a kv head) a tile takes to AMX; 0: none */
} AttentionCall;

/* One task with the dtype a constant. The OpenMP region is outlined before inlining, so a dtype flag
 * passed through it would stay a run-time value in the hot loops; these two functions fix it again. */
ALWAYS void attend_task(const AttentionCall *c, const Tile *tile, int64_t h0, int64_t h1, Scratch s, Fetch own,
                        Fetch *next, const int bf) {
#if HAVE_AMX
    if (bf && c->amx_lanes > 0 && tile->rows * c->g >= c->amx_lanes) {
        own.end = tile->max_len; /* fetched key group by key group, all of it */
        for (int64_t h = h0; h < h1; h++)
            amx_attend_head(tile, h, c->q, c->q_stride, c->k, c->v, c->row_len, c->out, c->hq, c->g, c->cap, c->scale,
                            s.off, s.sc, s.inv, *(AmxBuffers *)s.amx, &own, next, c->d);
        return;
    }
#endif
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
 * amx_lanes > 0: bf16 tiles of at least that many lanes (rows x g) go to AMX where AMX_ATTENTION (1: every
 * row, batch invariant; more: prefill tiles only, a row's bits then depending on whether it came in one);
 * 0: none.
 * Returns 0, or 1 if scratch memory could not be allocated (out is then incomplete). */
int paged_attention(const void *q, int64_t q_stride, const void *k, const void *v, const int32_t *bt,
                    int64_t bt_stride, const int32_t *row_seq, const int32_t *row_len, void *out, int64_t num_rows,
                    int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, int bf, int64_t amx_lanes) {
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
#if HAVE_AMX
    if (!AMX_ATTENTION(d, bf)) amx_lanes = 0;
#else
    amx_lanes = 0;
#endif
    const AttentionCall call = {q, k, v, row_len, out, q_stride, hq, g, cap, d, scale, amx_lanes};
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
                     malloc(sizeof(int64_t) * (cap > 0 ? cap : 1)), malloc(sizeof(int64_t) * (cap > 0 ? cap : 1)), NULL};
        failed = s.sc == NULL || s.off == NULL || s.next_off == NULL;
#if HAVE_AMX
        AmxBuffers amx_buffers = {0};
        if (amx_lanes > 0 && !failed) { /* lanes of one kv head: TILE_ROWS * g, a multiple of 16 */
            const int64_t cap32 = (cap + 31) / 32 * 32, head_lanes = TILE_ROWS * g;
            bf16 *buf = malloc(sizeof(bf16) * (head_lanes * d + 16 * d + 2 * head_lanes * cap32 + cap32 * d));
            float *ob = malloc(sizeof(float) * 16 * d);
            if (buf == NULL || ob == NULL) {
                free(buf);
                free(ob);
                failed = 1;
            } else {
                amx_buffers = (AmxBuffers){buf, buf + head_lanes * d, buf + head_lanes * d + 16 * d,
                                           buf + head_lanes * d + 16 * d + 2 * head_lanes * cap32, ob};
                s.amx = &amx_buffers;
                amx_configure();
            }
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
#if HAVE_AMX
        if (s.amx != NULL) {
            _tile_release();
            free(amx_buffers.qa);
            free(amx_buffers.ob);
        }
#endif
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
            exp_tail(neg, e, inter - i, 0.0f, 1.0f);
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
            for (int h = 0; h < 32 / VW; h++) {
                const vi off = (vi)((((vu){0} + (bits >> (VW * h))) >> lane) & 1u) == 0;
                vstore(x + t + VW * h, vselect(off, neg_inf, vload(x + t + VW * h)));
            }
        }
        for (; t < vocab; t++)
            if (!((m[t / 32] >> (t % 32)) & 1u)) x[t] = -INFINITY;
    }
}

/* ---- linears on weights packed once into column panels: fp32 and bf16 ----------------------------------
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
 * bf16 weights (linear_bf16) go through the same kernel, widened to fp32 as they are loaded (a shift): bf16 x
 * bf16 products are exact in fp32, and the sums are fp32, as in oneDNN's bf16 kernels. It serves the few-row
 * calls of a bf16 decode step where oneDNN's AMX kernels read the weights at about half the memory bandwidth
 * (cpu_kernels.SMALL_ROWS says up to which row count it wins), and every call where oneDNN has no bf16 kernels
 * (cpu_linear.own_kernel). The bf16 rows of x are widened a chunk at a time into a scratch buffer. */
/* The register tile of one ISA: PANEL_ROWS rows x PANEL_VECS vectors of PV_LANES outputs (AVX-512: 8 x 3 x 16,
 * 24 of its 32 registers; AVX2 + FMA: 4 x 3 x 8, 12 of its 16 registers, the other 4 for the panel's vectors and
 * the broadcast row value). pv_* are the few vector operations the tile needs. The arithmetic of an output is
 * the same on both (one multiply-add chain over k): only how many outputs and rows a tile holds differs. */
#if defined(__AVX512F__)
#define HAVE_PANELS 1
#define PANEL_ROWS 8
#define PV_LANES 16
#define PANEL_CHUNK_BYTES (1024 * 1024)
typedef __m512 pv;
static inline pv pv_zero(void) { return _mm512_setzero_ps(); }
static inline pv pv_set1(float x) { return _mm512_set1_ps(x); }
static inline pv pv_fma(pv a, pv b, pv c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS pv pv_load(const void *p, const int bf) {
    return bf ? (__m512)vload_bf16((const bf16 *)p) : _mm512_loadu_ps((const float *)p);
}
#define PV_IN_REGISTER(v) (void)(v)
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_PANELS 1
#define PANEL_ROWS 4
#define PV_LANES 8
#define PANEL_CHUNK_BYTES (256 * 1024) /* half of a Zen 3 core's L2 */
typedef __m256 pv;
static inline pv pv_zero(void) { return _mm256_setzero_ps(); }
static inline pv pv_set1(float x) { return _mm256_set1_ps(x); }
static inline pv pv_fma(pv a, pv b, pv c) { return _mm256_fmadd_ps(a, b, c); }
ALWAYS pv pv_load(const void *p, const int bf) { return ld8(p, 0, bf); }
/* GCC folds each of a k-step's 3 weight loads into its 4 multiply-adds (12 loads instead of 3): an L1-resident
 * slice then ran at 0.70-0.75x the speed of loading them once (a microbenchmark of the 4 x 24 tile, in turn). */
#define PV_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define HAVE_PANELS 0
#define PANEL_ROWS 1
#define PV_LANES 1
#define PANEL_CHUNK_BYTES 1
#endif
#define PANEL_VECS 3
#define PANEL_WIDTH (PV_LANES * PANEL_VECS)
#define PANEL_PREFETCH 32
#define PANEL_FETCHERS 8 /* the most row tiles of a panel that share fetching the next one */

/* The outputs per panel of pack_linear's layout, or 0 where the panel linears do not run (no AVX-512 or AVX2). */
int f32_linear_panel(void) { return HAVE_PANELS ? PANEL_WIDTH : 0; }

/* bf16 weights on CPUs with AMX, k a multiple of its tiles' 32: pairs of k-steps interleaved (see amx_panel). */
#if HAVE_AMX
#define AMX_PANELS(k, es) ((es) == 2 && (k) % 32 == 0 && amx_allowed())
#else
#define AMX_PANELS(k, es) 0
#endif

/* packed[p][i][j] = w[PANEL_WIDTH p + j][i] (0 past n): ceil(n / PANEL_WIDTH) panels of k x PANEL_WIDTH, of
 * elements of `es` bytes (4: fp32, 2: bf16); with AMX_PANELS, packed[p][i / 2][j][i % 2] instead (the same size). */
static void pack_linear(const void *w, int64_t n, int64_t k, void *packed, const int64_t es) {
    const int64_t panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    const int dp = AMX_PANELS(k, es);
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < PANEL_WIDTH; j++) {
                const int64_t row = p * PANEL_WIDTH + j;
                const int64_t at = dp ? p * k * PANEL_WIDTH + (i / 2 * PANEL_WIDTH + j) * 2 + i % 2
                                      : (p * k + i) * PANEL_WIDTH + j;
                char *dst = (char *)packed + at * es;
                if (row < n)
                    memcpy(dst, (const char *)w + (row * k + i) * es, es);
                else
                    memset(dst, 0, es);
            }
}
void pack_f32_linear(const float *w, int64_t n, int64_t k, float *packed) { pack_linear(w, n, k, packed, 4); }
void pack_bf16_linear(const bf16 *w, int64_t n, int64_t k, bf16 *packed) { pack_linear(w, n, k, packed, 2); }

#if HAVE_PANELS
/* rows x PV_LANES outputs of vector q of a tile plus the bias, stored at y (row stride ldy) in the weights'
 * dtype; only the first `left` (< PV_LANES: the last panel's tail) when fewer remain. */
ALWAYS void panel_store(pv *acc, int rows, int64_t q, void *y, int64_t ldy, int64_t left, const void *bias,
                        const int bf) {
#if defined(__AVX512F__)
    const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    if (!bf) {
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, (const float *)bias + 16 * q) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps((float *)y + r * ldy + 16 * q, mask, _mm512_add_ps(acc[r * PANEL_VECS], b));
        return;
    }
#endif
    const int64_t es = bf ? 2 : 4, n = left < PV_LANES ? left : PV_LANES;
    float b[PV_LANES] = {0}, out[PV_LANES];
    for (int64_t j = 0; bias != NULL && j < n; j++) b[j] = ld1(bias, PV_LANES * q + j, bf);
    for (int r = 0; r < rows; r++) {
        pv v = acc[r * PANEL_VECS];
        memcpy(out, &v, sizeof out);
        char *dst = (char *)y + (r * ldy + PV_LANES * q) * es;
        if (!bf && n == PV_LANES) {
            for (int j = 0; j < PV_LANES; j++) out[j] += b[j];
            memcpy(dst, out, sizeof out);
        } else {
            for (int64_t j = 0; j < n; j++) st1(dst, j, out[j] + b[j], bf);
        }
    }
}

/* rows x width outputs at y (row stride ldy, dtype ybf) from fp32 rows of x (stride ldx) and kn k-steps of one
 * packed panel, fp32 (wbf = 0) or bf16 (wbf = 1) weights, x and w at the tile's first k-step. When those are not
 * all of the k (the chunk is blocked in k), the sums so far come from `part` (unless `first`) and go back to it
 * (unless `last`), fp32 (rows x PANEL_WIDTH): the chain of multiply-adds is the same as in one pass. `next`, if
 * not NULL, is the panel after it, fetched into L2 meanwhile (the first row tile of a panel would otherwise wait
 * on memory for its weights): this tile, number `tile` of the `tiles` that share it (the panel's first
 * PANEL_FETCHERS), fetches its part, so that the memory stream goes on while the later tiles compute from cache
 * (fetched by the first tile alone, a 16-row call took the time of the stream plus that of the second tile's
 * compute). Without `stream` (the weights are in L1) it fetches nothing. */
ALWAYS void panel_tile(const int rows, const float *x, int64_t ldx, const void *panel, int64_t kn, float *part,
                       int first, int last, void *y, int64_t ldy, int64_t width, const void *bias, const void *next,
                       int64_t tile, int64_t tiles, int stream, const int wbf, const int ybf) {
    const int64_t step = PANEL_WIDTH * (wbf ? 2 : 4); /* bytes of one k-step of a panel */
    const char *pw = panel, *pn = next;
    /* k-step i of this tile fetches row fetch_row of the next panel when i == fetch_at: rows at even steps
     * over the panel's tiles x k steps */
    int64_t fetch_row = (tile * kn + tiles - 1) / tiles, fetch_at = fetch_row * tiles - tile * kn;
    pv acc[PANEL_ROWS][PANEL_VECS];
    for (int r = 0; r < rows; r++)
        for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = first ? pv_zero() : pv_load(part + r * PANEL_WIDTH + PV_LANES * q, 0);
    if (!stream) {
#pragma GCC unroll 4
        for (int64_t i = 0; i < kn; i++) {
            pv w[PANEL_VECS];
            for (int q = 0; q < PANEL_VECS; q++) {
                w[q] = pv_load(pw + i * step + PV_LANES * q * (wbf ? 2 : 4), wbf);
                PV_IN_REGISTER(w[q]);
            }
            for (int r = 0; r < rows; r++) {
                const pv xv = pv_set1(x[r * ldx + i]);
                for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = pv_fma(xv, w[q], acc[r][q]);
            }
        }
    }
#pragma GCC unroll 4
    for (int64_t i = 0; stream && i < kn; i++) {
        pv w[PANEL_VECS];
        for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pw + (i + PANEL_PREFETCH) * step + b, _MM_HINT_T0);
        for (int q = 0; q < PANEL_VECS; q++) w[q] = pv_load(pw + i * step + PV_LANES * q * (wbf ? 2 : 4), wbf);
        if (pn != NULL && i == fetch_at) {
            for (int64_t b = 0; b < step; b += 64) _mm_prefetch(pn + fetch_row * step + b, _MM_HINT_T1);
            fetch_row++;
            fetch_at += tiles;
        }
        for (int r = 0; r < rows; r++) {
            const pv xv = pv_set1(x[r * ldx + i]);
            for (int q = 0; q < PANEL_VECS; q++) acc[r][q] = pv_fma(xv, w[q], acc[r][q]);
        }
    }
    if (!last) {
        for (int r = 0; r < rows; r++)
            for (int q = 0; q < PANEL_VECS; q++) memcpy(part + r * PANEL_WIDTH + PV_LANES * q, &acc[r][q], sizeof(pv));
        return;
    }
    for (int q = 0; q < PANEL_VECS; q++) {
        const int64_t left = width - PV_LANES * q;
        if (left <= 0) break;
        panel_store(&acc[0][q], rows, q, y, ldy, left, bias, ybf);
    }
}

/* panel_tile with rows and dtypes constants, compiled on its own: inlined into the chunk loop, its 16 live vectors
 * (AVX2) got spilled to the stack in some of the instantiations (bf16 weights widened per slice ran at half the
 * fp32 speed). */
#define PANEL_TILE_FN(R, W, Y) \
    static __attribute__((noinline)) void panel_tile_##R##_##W##Y( \
        const float *x, int64_t ldx, const void *panel, int64_t kn, float *part, int first, int last, void *y, \
        int64_t ldy, int64_t width, const void *bias, const void *next, int64_t tile, int64_t tiles, int stream) { \
        panel_tile(R, x, ldx, panel, kn, part, first, last, y, ldy, width, bias, next, tile, tiles, stream, W, Y); \
    }
#define PANEL_TILE_FNS(R) PANEL_TILE_FN(R, 0, 0) PANEL_TILE_FN(R, 1, 1) PANEL_TILE_FN(R, 0, 1)
PANEL_TILE_FNS(1) PANEL_TILE_FNS(2) PANEL_TILE_FNS(3) PANEL_TILE_FNS(4)
#if PANEL_ROWS > 4
PANEL_TILE_FNS(5) PANEL_TILE_FNS(6) PANEL_TILE_FNS(7) PANEL_TILE_FNS(8)
#endif

/* The row tiles of a chunk, rows [m0, end), on k-steps [k0, k1) of one panel (w at k0). */
ALWAYS void panel_tiles(const float *xc, int64_t ldc, int64_t m0, int64_t end, const void *w, int64_t k, int64_t k0,
                        int64_t k1, float *part, void *y, int64_t n, int64_t col, int64_t width, const void *bias,
                        const void *next, int blocked, const int wbf, const int ybf) {
    const int64_t tiles = (end - m0 + PANEL_ROWS - 1) / PANEL_ROWS;
    const int64_t fetchers = tiles < PANEL_FETCHERS ? tiles : PANEL_FETCHERS; /* tiles that fetch `next` */
    for (int64_t i = m0; i < end; i += PANEL_ROWS) {
        const int64_t t = (i - m0) / PANEL_ROWS;
        const float *xt = xc + (i - m0) * ldc + k0;
        float *pt = part + (i - m0) * PANEL_WIDTH;
        void *yt = (char *)y + (i * n + col) * (ybf ? 2 : 4);
        /* a blocked chunk's first tile brings the slice into L1; the ones after it find it there */
        const int stream = !blocked || (i == m0 && wbf == ybf), first = k0 == 0, last = k1 == k;
        const void *nt = !blocked && t < fetchers ? next : NULL;
#define PANEL_TILE(R) \
    case R: \
        if (wbf != ybf) \
            panel_tile_##R##_01(xt, ldc, w, k1 - k0, pt, first, last, yt, n, width, bias, nt, t, fetchers, stream); \
        else if (wbf) \
            panel_tile_##R##_11(xt, ldc, w, k1 - k0, pt, first, last, yt, n, width, bias, nt, t, fetchers, stream); \
        else \
            panel_tile_##R##_00(xt, ldc, w, k1 - k0, pt, first, last, yt, n, width, bias, nt, t, fetchers, stream); \
        break;
        switch (end - i < PANEL_ROWS ? end - i : PANEL_ROWS) {
            PANEL_TILE(1) PANEL_TILE(2) PANEL_TILE(3) PANEL_TILE(4)
#if PANEL_ROWS > 4
            PANEL_TILE(5) PANEL_TILE(6) PANEL_TILE(7) PANEL_TILE(8)
#endif
            default: break;
        }
#undef PANEL_TILE
    }
}

#if HAVE_AMX
/* bf16 linears on AMX (AMX_PANELS). A decode step's 2-24 rows make a pass over the weights compute-bound on
 * vector units (widened to fp32, 9 rows took 1.5x the time of 1 row over SmolLM2's linears; vdpbf16ps does no
 * more flops a cycle than fp32 multiply-adds on this CPU and was slower still), where one AMX tile product does
 * 16 rows x 16 outputs x 32 k-steps. Each panel is three B tiles wide (16 pairs of k-steps x 16 outputs,
 * vdpbf16ps's pair layout, rows PANEL_WIDTH * 4 bytes apart); the rows go in tiles of 16, three C tiles of fp32
 * sums each, over k in chunks of 32. With one row tile a panel streams once, with the panel kernel's software
 * prefetch. With more, the panel goes in k blocks of AMX_KB chunks that stay in L1 while every row tile of the
 * call's row chunk takes them in turn (its sums parked in `part` between blocks), instead of each row tile
 * reading the whole panel again from L2 (64 rows: 17.5-18.5 ms against 20.1 over SmolLM2's linears). Past
 * about 128 rows oneDNN's AMX kernels are as fast or faster (cpu_kernels.AMX_SMALL_ROWS); here a pass at 128
 * rows takes about the weight stream's time plus the compute's (30 ms against 11 + 17), and prefetching the
 * next k block during the other row tiles' compute did not change that. An output's sum is the same chain of tile
 * products whatever the row count, so a row's result does not depend on the other rows. */
#define AMX_ROWS 16
#define AMX_K 32
#define AMX_KB 8                        /* chunks of a k block: 24 KiB of the panel */
#define AMX_CHUNK_BYTES (256 * 1024)    /* the rows of x a row chunk holds (they stay in L2) */

/* Rows [r0, r0 + 16) of y, panel columns [col, col + width), from the fp32 sums (16 x PANEL_WIDTH) plus b. */
static void amx_store(const float *sums, int64_t r0, int64_t rows, bf16 *y, int64_t n, int64_t col, int64_t width,
                      const vf *b) {
    for (int64_t r = 0; r < AMX_ROWS && r0 + r < rows; r++) {
        bf16 *out = y + (r0 + r) * n + col, row[PANEL_WIDTH];
        bf16 *dst = width == PANEL_WIDTH ? out : row;
        for (int q = 0; q < PANEL_VECS; q++)
            vstore_bf16(dst + PV_LANES * q, vload(sums + r * PANEL_WIDTH + PV_LANES * q) + b[q]);
        if (dst != out) memcpy(out, row, 2 * width);
    }
}

/* One panel (col, width outputs) for rows [m0, end) of y: row tile i's A rows at a[i] (k bf16 each, k * 2 bytes
 * apart), bias or NULL, part: (end - m0) x PANEL_WIDTH fp32 of scratch. A thread's panels are consecutive in
 * memory, so the prefetch runs on into the next one. */
static void amx_panel(const bf16 *const *a, int64_t m0, int64_t end, const char *panel, int64_t k, bf16 *y,
                      int64_t n, int64_t col, int64_t width, const bf16 *bias, float *part) {
    const int64_t pair_row = PANEL_WIDTH * 4, chunk = AMX_K / 2 * pair_row; /* bytes of one k chunk of the panel */
    const int64_t chunks = k / AMX_K, tiles = (end - m0 + AMX_ROWS - 1) / AMX_ROWS;
    const int64_t kb = tiles == 1 ? chunks : AMX_KB;
    float sums[AMX_ROWS * PANEL_WIDTH];
    vf b[PANEL_VECS];
    for (int q = 0; q < PANEL_VECS; q++) {
        bf16 lanes[PV_LANES] = {0};
        const int64_t left = width - PV_LANES * q;
        if (bias != NULL && left > 0) memcpy(lanes, bias + col + PV_LANES * q, 2 * (left < PV_LANES ? left : PV_LANES));
        b[q] = vload_bf16(lanes);
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += kb) {
        const int64_t c1 = c0 + kb < chunks ? c0 + kb : chunks;
        for (int64_t t = 0; t < tiles; t++) {
            float *pt = part + t * AMX_ROWS * PANEL_WIDTH;
            if (c0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
            } else {
                _tile_loadd(0, pt, PANEL_WIDTH * 4);
                _tile_loadd(1, pt + 16, PANEL_WIDTH * 4);
                _tile_loadd(2, pt + 32, PANEL_WIDTH * 4);
            }
            for (int64_t c = c0; c < c1; c++) {
                const char *w = panel + c * chunk;
                if (t == 0) /* the first row tile brings the block into L1; the others find it there */
                    for (int64_t at = 0; at < chunk; at += 64) _mm_prefetch(w + 2 * chunk + at, _MM_HINT_T0);
                _tile_loadd(3, a[t] + c * AMX_K, k * 2);
                _tile_loadd(4, w, pair_row);
                _tile_loadd(5, w + 64, pair_row);
                _tile_loadd(6, w + 128, pair_row);
                _tile_dpbf16ps(0, 3, 4);
                _tile_dpbf16ps(1, 3, 5);
                _tile_dpbf16ps(2, 3, 6);
            }
            float *dst = c1 == chunks ? sums : pt;
            _tile_stored(0, dst, PANEL_WIDTH * 4);
            _tile_stored(1, dst + 16, PANEL_WIDTH * 4);
            _tile_stored(2, dst + 32, PANEL_WIDTH * 4);
            if (c1 == chunks) amx_store(sums, m0 + t * AMX_ROWS, end, y, n, col, width, b);
        }
    }
}

/* y [rows, n] = x [rows, k] W^T + bias on AMX_PANELS weights, in row chunks of about AMX_CHUNK_BYTES of x (a
 * last row tile of fewer than 16 rows through a zero-padded copy); 0, or 1 without scratch memory (y is then
 * not written). */
static int linear_amx(const bf16 *x, int64_t rows, const void *packed, int64_t n, int64_t k, const bf16 *bias,
                      bf16 *y) {
    const int64_t full = rows / AMX_ROWS * AMX_ROWS, tiles = (rows + AMX_ROWS - 1) / AMX_ROWS;
    int64_t chunk_tiles = AMX_CHUNK_BYTES / (2 * k * AMX_ROWS);
    if (chunk_tiles < 1) chunk_tiles = 1;
    const int64_t chunk = chunk_tiles * AMX_ROWS;
    bf16 *tail = malloc(sizeof(bf16) * AMX_ROWS * k);
    const bf16 **a = malloc(sizeof(bf16 *) * tiles);
    if (tail == NULL || a == NULL) {
        free(tail);
        free(a);
        return 1;
    }
    memset(tail, 0, sizeof(bf16) * AMX_ROWS * k);
    memcpy(tail, x + full * k, sizeof(bf16) * (rows - full) * k);
    for (int64_t t = 0; t < tiles; t++) a[t] = t * AMX_ROWS < full ? x + t * AMX_ROWS * k : tail;
    const int64_t panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    int failed = 0;
#pragma omp parallel if (n * k > PAR_MIN_WORK) reduction(| : failed)
    {
        float *part = malloc(sizeof(float) * (rows < chunk ? tiles * AMX_ROWS : chunk) * PANEL_WIDTH);
        failed = part == NULL;
        if (!failed) amx_configure();
        for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
            const int64_t end = m0 + chunk < rows ? m0 + chunk : rows;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                if (part == NULL) continue;
                const char *panel = (const char *)packed + p * k * PANEL_WIDTH * 2;
                const int64_t col = p * PANEL_WIDTH, width = n - col < PANEL_WIDTH ? n - col : PANEL_WIDTH;
                amx_panel(a + m0 / AMX_ROWS, m0, end, panel, k, y, n, col, width, bias, part);
            }
        }
        if (!failed) _tile_release();
        free(part);
    }
    free(tail);
    free(a);
    return failed;
}
#endif

/* A chunk of at least PANEL_BLOCK_TILES row tiles (compute-bound: the weights are read from cache, not memory)
 * walks each panel in slices of PANEL_KC k-steps, every tile of the chunk in turn on one slice, so that the slice
 * stays in L1 (fp32: 24 KiB at AVX2's 24 outputs), instead of each tile streaming the whole panel from L2; a bf16
 * slice is widened to fp32 once, not by every tile. Measured on AVX2 (AMD EPYC, 2 threads, SmolLM2's layer
 * shapes at 512-2048 rows): 1.64x oneDNN's time in one pass, 1.05x blocked. AVX-512 CPUs keep one pass
 * (PANEL_KC 0): measured there, k-blocking did not pay. */
#define PANEL_BLOCK_TILES 4
#if PV_LANES == 8
#define PANEL_KC (24576 / (PANEL_WIDTH * 4) / 8 * 8)
#else
#define PANEL_KC 0
#endif

/* One thread's share of linear_panels, inside its parallel region (panels split by `omp for`), the dtype a
 * constant: a flag passed into the region would stay a run-time test in the k loop. bf16 rows of x are widened
 * a chunk at a time into xf (chunk x k fp32, shared by the threads), by one thread while the others wait; in a
 * blocked chunk each bf16 weight slice is widened into wf (PANEL_KC x PANEL_WIDTH fp32, the thread's own). */
ALWAYS void panel_rows(const void *x, int64_t ldx, int64_t rows, const void *packed, int64_t n, int64_t k,
                       const void *bias, void *y, int64_t chunk, float *xf, float *part, float *wf, const int bf) {
    const int64_t es = bf ? 2 : 4, panels = (n + PANEL_WIDTH - 1) / PANEL_WIDTH;
    const int blocked = part != NULL;
    const int64_t kc = blocked ? PANEL_KC : k, ldc = bf ? k : ldx;
    for (int64_t m0 = 0; m0 < rows; m0 += chunk) {
        const int64_t end = m0 + chunk < rows ? m0 + chunk : rows;
        const float *xc = bf ? xf : (const float *)x + m0 * ldx; /* the chunk's fp32 rows, ldc apart */
        if (bf) {
#pragma omp single
            for (int64_t i = 0; i < (end - m0) * k; i++) xf[i] = bf16_to_f(((const bf16 *)x)[m0 * ldx + i]);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const char *panel = (const char *)packed + p * k * PANEL_WIDTH * es;
            const int64_t col = p * PANEL_WIDTH, width = n - col < PANEL_WIDTH ? n - col : PANEL_WIDTH;
            const void *b = bias != NULL ? (const char *)bias + col * es : NULL;
            const void *next = p + 1 < panels ? panel + k * PANEL_WIDTH * es : NULL;
            for (int64_t k0 = 0; k0 < k; k0 += kc) {
                const int64_t k1 = k0 + kc < k ? k0 + kc : k;
                const char *w = panel + k0 * PANEL_WIDTH * es;
                if (bf && blocked) {
                    for (int64_t i = 0; i < (k1 - k0) * PANEL_WIDTH; i++) wf[i] = bf16_to_f(((const bf16 *)w)[i]);
                    panel_tiles(xc, ldc, m0, end, wf, k, k0, k1, part, y, n, col, width, b, next, 1, 0, 1);
                } else {
                    panel_tiles(xc, ldc, m0, end, w, k, k0, k1, part, y, n, col, width, b, next, blocked, bf, bf);
                }
            }
        }
    }
}

/* y [rows, n] (contiguous) = x [rows, k] W^T + bias, W packed by pack_linear; x, W, bias and y fp32 (bf = 0;
 * x's rows ldx apart) or bf16 (bf = 1; x's rows contiguous, ldx = k). Returns 0, or 1 if the bf16 rows' fp32
 * scratch could not be allocated (y is then not written). */
static int linear_panels(const void *x, int64_t ldx, int64_t rows, const void *packed, int64_t n, int64_t k,
                         const void *bias, void *y, int bf) {
    int64_t chunk = PANEL_CHUNK_BYTES / (4 * k) / PANEL_ROWS * PANEL_ROWS;
    if (chunk < PANEL_ROWS) chunk = PANEL_ROWS;
    const int64_t chunks = (rows + chunk - 1) / chunk; /* equal chunks: 256 rows are not 224 + 32 */
    chunk = ((rows + chunks - 1) / chunks + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
    const int blocked = PANEL_KC > 0 && k > PANEL_KC && (chunk < rows ? chunk : rows) >= PANEL_BLOCK_TILES * PANEL_ROWS;
    float *xf = bf ? malloc(sizeof(float) * (chunk < rows ? chunk : rows) * k) : NULL;
    if (bf && xf == NULL) return 1;
#pragma omp parallel if (n * k > PAR_MIN_WORK)
    {
        /* the row tiles' partial sums between k slices, chunk x PANEL_WIDTH fp32, and a widened bf16 weight slice
         * (without them, one pass) */
        float *part = blocked ? malloc(sizeof(float) * (chunk + PANEL_KC) * PANEL_WIDTH) : NULL;
        BY_DTYPE(bf, panel_rows, x, ldx, rows, packed, n, k, bias, y, chunk, xf, part,
                 part != NULL ? part + chunk * PANEL_WIDTH : NULL);
        free(part);
    }
    free(xf);
    return 0;
}
#endif

/* y [rows, n] (contiguous) = x [rows, k] (row stride ldx) W^T + bias; W packed by pack_f32_linear; bias NULL
 * or [n]. A no-op where f32_linear_panel() is 0, or for 0 rows. */
void linear_f32(const float *x, int64_t ldx, int64_t rows, const float *packed, int64_t n, int64_t k,
                const float *bias, float *y) {
#if HAVE_PANELS
    if (rows > 0) linear_panels(x, ldx, rows, packed, n, k, bias, y, 0);
#else
    (void)x, (void)ldx, (void)rows, (void)packed, (void)n, (void)k, (void)bias, (void)y;
#endif
}

/* Whether bf16 linears with k a multiple of 32 run on AMX tiles here (the library built for a CPU with AMX, and
 * the kernel allowing the process its tile state). */
int amx_linears(void) {
#if HAVE_AMX
    return amx_allowed();
#else
    return 0;
#endif
}

/* The same for bf16: x [rows, k] bf16 (rows contiguous), W packed by pack_bf16_linear, bias NULL or [n] bf16,
 * y [rows, n] bf16; each output's fp32 sum is rounded to bf16 once. Returns 0, or 1 if the scratch for x's
 * widened rows (a chunk of them at a time) could not be allocated (y is then not written). */
int linear_bf16(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k, const bf16 *bias, bf16 *y) {
#if HAVE_AMX
    if (AMX_PANELS(k, 2)) return rows > 0 ? linear_amx(x, rows, packed, n, k, bias, y) : 0;
#endif
#if HAVE_PANELS
    if (rows > 0) return linear_panels(x, k, rows, packed, n, k, bias, y, 1);
#else
    (void)x, (void)rows, (void)packed, (void)n, (void)k, (void)bias, (void)y;
#endif
    return 0;
}
