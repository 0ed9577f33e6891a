/* The lm_head's selection kernels: the lm_head with each row's largest outputs found as they pass (linear_bf16_top:
 * the [rows, vocab] logits are never written), the fp32 refinement of a row's top candidates (refine_logits) and
 * the greedy token from them (top_argmax), a sampled token from the row in cache (sample_bf16), and the fp32
 * lm_head's greedy token a chunk of the vocabulary at a time (greedy_f32). */
#include "common.h"

/* linears.c */
extern int linear_bf16(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k, const bf16 *bias,
                       bf16 *y);
extern int f32_linear_panel(void);
extern void linear_f32(const float *x, int64_t ldx, int64_t rows, const float *packed, int64_t n, int64_t k,
                       const float *bias, float *y);
/* sampling.c */
extern void logits_top_row(const bf16 *x, float *o, int64_t vocab, int64_t k, int64_t *idx);
extern int64_t sample_logits_row(const float *x, int64_t vocab, float temperature, int64_t top_k, float top_p,
                                 float min_p, double u);

#define TOP_SCRATCH_BYTES (1024 * 1024) /* one chunk's outputs, all rows: within a core's L2 */

/* The outputs of a vocabulary chunk: whole panels whose outputs for all rows fit TOP_SCRATCH_BYTES, at least one. */
static int64_t chunk_width(int64_t rows, size_t element, int64_t panel, int64_t n) {
    int64_t width = TOP_SCRATCH_BYTES / (int64_t)(element * rows) / panel * panel;
    if (width < panel) width = panel;
    return width > n ? n : width;
}

/* *buf holding at least `bytes` (grown, kept between calls: the caller's thread's), or NULL without memory. */
static void *grown(void **buf, size_t *cap, size_t bytes) {
    if (*cap < bytes) {
        free(*buf);
        *buf = malloc(bytes);
        *cap = *buf != NULL ? bytes : 0;
    }
    return *buf;
}

/* A kept list: val/idx in the row's order (ranks_before), `count` of at most `top` kept. (v, i) goes in its place
 * when it ranks before the last kept one or the list has room. */
static void top_insert(float *val, int64_t *idx, int64_t *count, int64_t top, float v, int64_t i) {
    if (*count == top && !ranks_before(v, i, val[top - 1], idx[top - 1])) return;
    int64_t j = *count < top ? (*count)++ : top - 1;
    for (; j > 0 && ranks_before(v, i, val[j - 1], idx[j - 1]); j--) {
        val[j] = val[j - 1];
        idx[j] = idx[j - 1];
    }
    val[j] = v;
    idx[j] = i;
}

/* Output i, of value v, into the kept list, or noted as the row's first NaN (nan: -1 none yet). */
static inline void top_take(float v, int64_t i, float *val, int64_t *idx, int64_t *count, int64_t top,
                            int64_t *nan) {
    if (v != v) {
        if (*nan < 0) *nan = i;
    } else {
        top_insert(val, idx, count, top, v, i);
    }
}

/* One row's outputs [c0, c0 + width) into its kept list, in index order (so a value equal to the last kept one
 * never goes in): one vector compare skips VW outputs below the last kept one. */
static void top_scan(const bf16 *y, int64_t width, int64_t c0, float *val, int64_t *idx, int64_t *count,
                     int64_t top, int64_t *nan) {
    int64_t i = 0;
    for (; i < width && (*count < top || i % VW); i++) top_take(bf16_to_f(y[i]), c0 + i, val, idx, count, top, nan);
    for (; i + VW <= width; i += VW)
        if (any_above_or_nan(vload_bf16(y + i), val[top - 1]))
            for (int64_t t = i; t < i + VW; t++) top_take(bf16_to_f(y[t]), c0 + t, val, idx, count, top, nan);
    for (; i < width; i++) top_take(bf16_to_f(y[i]), c0 + i, val, idx, count, top, nan);
}

/* A thread's kept lists, one per row. */
typedef struct {
    float *val;
    int64_t *idx, *count, *nan;
} Kept;

static Kept kept_at(char *base, int64_t rows, int64_t top) {
    Kept k = {NULL, (int64_t *)base, NULL, NULL};
    k.count = k.idx + rows * top;
    k.nan = k.count + rows;
    k.val = (float *)(k.nan + rows);
    return k;
}

/* For each row of x [rows, k] (bf16, contiguous): the `top` largest of x W^T (W packed for linear_bf16, n outputs,
 * no bias) as fp32 values [rows, top] and their indices [rows, top], in the row's order (value descending, equal
 * values by index), NaN outputs left out; nan[r] is row r's first NaN output (-1: none); a row of fewer than `top`
 * others ends in NaN values at that index. A thread scans the outputs it computed (the panels' split), keeping its
 * own lists, merged at the end. 1 without memory (nothing written). */
int linear_bf16_top(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k, int64_t top, float *values,
                    int64_t *ids, int64_t *nan) {
    static __thread void *buffer;
    static __thread size_t buffer_bytes;
    const int64_t panel = f32_linear_panel(), threads = omp_get_max_threads();
    if (rows <= 0) return 0;
    if (panel <= 0 || top <= 0 || top > n) return 1;
    const int64_t width = chunk_width(rows, sizeof(bf16), panel, n);
    bf16 *scratch = grown(&buffer, &buffer_bytes, sizeof(bf16) * rows * width);
    if (scratch == NULL) return 1;
    const bf16 *y = scratch; /* the caller's thread's: the parallel region's threads have their own */
    /* each thread's lists on lines of their own */
    const size_t list_bytes = (sizeof(float) + sizeof(int64_t)) * rows * top + 2 * sizeof(int64_t) * rows;
    const size_t per_thread = (list_bytes + 63) / 64 * 64;
    char *lists = malloc(per_thread * threads);
    if (lists == NULL) return 1;
    for (int64_t t = 0; t < threads; t++) {
        const Kept kt = kept_at(lists + t * per_thread, rows, top);
        for (int64_t r = 0; r < rows; r++) kt.count[r] = 0, kt.nan[r] = -1;
    }
    for (int64_t c0 = 0; c0 < n; c0 += width) {
        const int64_t w = n - c0 < width ? n - c0 : width, panels = (w + panel - 1) / panel;
        if (linear_bf16(x, rows, packed + c0 * k, w, k, NULL, scratch)) {
            free(lists);
            return 1;
        }
#pragma omp parallel if (rows * w > PAR_MIN_WORK)
        {
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t lo = panels * me / team * panel, hi_panel = panels * (me + 1) / team * panel;
            const int64_t hi = hi_panel < w ? hi_panel : w;
            const Kept kt = kept_at(lists + me * per_thread, rows, top);
            for (int64_t r = 0; r < rows && lo < hi; r++)
                top_scan(y + r * w + lo, hi - lo, c0 + lo, kt.val + r * top, kt.idx + r * top, kt.count + r, top,
                         kt.nan + r);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *val = values + r * top;
        int64_t *idx = ids + r * top, count = 0;
        nan[r] = -1;
        for (int64_t t = 0; t < threads; t++) {
            const Kept kt = kept_at(lists + t * per_thread, rows, top);
            for (int64_t j = 0; j < kt.count[r]; j++)
                top_insert(val, idx, &count, top, kt.val[r * top + j], kt.idx[r * top + j]);
            if (kt.nan[r] >= 0 && (nan[r] < 0 || kt.nan[r] < nan[r])) nan[r] = kt.nan[r];
        }
        for (int64_t j = count; j < top; j++) val[j] = NAN, idx[j] = nan[r];
    }
    free(lists);
    return 0;
}

/* x . w over dim values (bf16 or fp32, both the same) in fp32: VW lanes of sums in order, then hsum. */
ALWAYS float dot_row(const void *x, const void *w, int64_t dim, const int bf) {
    vf acc = vsplat(0.0f);
    int64_t i = 0;
    for (; i + VW <= dim; i += VW) acc += ldv(x, i, bf) * ldv(w, i, bf);
    for (int64_t j = 0; i < dim; i++, j++) acc[j] += ld1(x, i, bf) * ld1(w, i, bf);
    return hsum(acc);
}

ALWAYS void refine_rows(const void *hidden, int64_t rows, int64_t dim, const void *weight, const int64_t *ids,
                        int64_t ldi, int64_t k, float *out, int64_t ldo, const int bf) {
    const int64_t es = bf ? 2 : 4;
#pragma omp parallel for if (rows * k * dim > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++)
            out[r * ldo + j] = dot_row((const char *)hidden + r * dim * es,
                                       (const char *)weight + ids[r * ldi + j] * dim * es, dim, bf);
}

/* out[r * ldo + j] = hidden[r] . weight[ids[r * ldi + j]] in fp32 for j < k: row r's logits at those ids from the
 * plain weight [*, dim] (hidden and weight both fp32, or both bf16: bf), each one dot product whose bits never
 * depend on the rows beside it. */
void refine_logits(const void *hidden, int64_t rows, int64_t dim, const void *weight, const int64_t *ids, int64_t ldi,
                   int64_t k, float *out, int64_t ldo, int bf) {
    BY_DTYPE(bf, refine_rows, hidden, rows, dim, weight, ids, ldi, k, out, ldo);
}

/* tokens[r]: the id of row r's largest value of values [rows, top], the smallest id among equal ones (the first
 * maximum of the whole row, where its other values are at most the last one at later ids). Returns 1, tokens
 * unset, when a value is NaN or nan[r] >= 0 for some row (the argmax takes a NaN as the largest). */
int top_argmax(const float *values, const int64_t *ids, const int64_t *nan, int64_t rows, int64_t top,
               int64_t *tokens) {
    for (int64_t r = 0; r < rows; r++) {
        const float *v = values + r * top;
        const int64_t *i = ids + r * top;
        if (nan[r] >= 0) return 1;
        int64_t best = 0;
        for (int64_t j = 0; j < top; j++) {
            if (v[j] != v[j]) return 1;
            if (ranks_before(v[j], i[j], v[best], i[best])) best = j;
        }
        tokens[r] = i[best];
    }
    return 0;
}

/* tokens[r]: row r's greedy token from bf16 x [rows, k] and the lm_head packed for linear_bf16 (n outputs, no bias)
 * with its plain bf16 weight [n, k]: the `top` largest outputs of linear_bf16_top, the first top - 1 refined in fp32
 * by refine_logits, then top_argmax; the three calls the Python path makes, in one. 0 when done, 1 where a row has a
 * NaN (tokens unset: the caller takes the whole logits), -1 without memory. */
int greedy_bf16(const bf16 *x, int64_t rows, const bf16 *packed, const bf16 *weight, int64_t n, int64_t k,
                int64_t top, int64_t *tokens) {
    if (rows <= 0) return 0;
    const size_t bytes = (sizeof(float) + sizeof(int64_t)) * rows * top + sizeof(int64_t) * rows;
    char *buf = malloc(bytes);
    if (buf == NULL) return -1;
    float *values = (float *)buf;
    int64_t *ids = (int64_t *)(values + rows * top), *nan = ids + rows * top;
    int status = linear_bf16_top(x, rows, packed, n, k, top, values, ids, nan) ? -1 : 0;
    if (status == 0) {
        refine_logits(x, rows, k, weight, ids, top, top - 1, values, top, 1);
        status = top_argmax(values, ids, nan, rows, top, tokens);
    }
    free(buf);
    return status;
}

/* The lm_head's bf16 outputs [rows, n]: linear_bf16 of x into the caller's thread's kept buffer; NULL without memory. */
static const bf16 *lm_outputs(const bf16 *x, int64_t rows, const bf16 *packed, int64_t n, int64_t k) {
    static __thread void *buffer;
    static __thread size_t buffer_bytes;
    bf16 *y = grown(&buffer, &buffer_bytes, sizeof(bf16) * rows * n);
    return y == NULL || linear_bf16(x, rows, packed, n, k, NULL, y) ? NULL : y;
}

/* One row's compute_logits fp32 logits o [n] from its lm_head outputs y [n] (bf16) and its x [k]: widened, the `top`
 * largest found (logits_top_row, their ids into idx) and refined in fp32 by dot_row. */
static void logits_row(const bf16 *y, const bf16 *x, const bf16 *weight, int64_t n, int64_t k, int64_t top, float *o,
                       int64_t *idx) {
    logits_top_row(y, o, n, top, idx);
    for (int64_t j = 0; j < top; j++) o[idx[j]] = dot_row(x, weight + idx[j] * k, k, 1);
}

/* out [rows, n]: compute_logits' fp32 logits from bf16 x [rows, k], the lm_head packed for linear_bf16 (no bias) and
 * its plain bf16 weight [n, k], each row by logits_row: the calls the Python path makes (the lm_head, logits_top,
 * refine_logits), in one. 0 when done, -1 without memory or with `top` outside [1, min(n, 64)]. */
int logits_bf16(const bf16 *x, int64_t rows, const bf16 *packed, const bf16 *weight, int64_t n, int64_t k,
                int64_t top, float *out) {
    if (rows <= 0) return 0;
    if (top < 1 || top > 64 || top > n) return -1;
    const bf16 *y = lm_outputs(x, rows, packed, n, k);
    if (y == NULL) return -1;
#pragma omp parallel for if (rows * n > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        int64_t idx[64];
        logits_row(y + r * n, x + r * k, weight, n, k, top, out + r * n, idx);
    }
    return 0;
}

/* A thread's row of logits (fp32 [n]), kept between calls. */
static __thread float *row_logits;
static __thread int64_t row_cap;

/* tokens[r]: row r of logits_bf16's fp32 logits drawn as sample_rows draws it (temperature[r] 0: the first maximum;
 * top_k, top_p, min_p NULL: off for every row), the row built by logits_row in a thread's buffer: the same bits, the
 * [rows, n] fp32 logits never written. 0 when done, -1 as logits_bf16. */
int sample_bf16(const bf16 *x, int64_t rows, const bf16 *packed, const bf16 *weight, int64_t n, int64_t k,
                int64_t top, const float *temperature, const int64_t *top_k, const float *top_p, const float *min_p,
                const double *u, int64_t *tokens) {
    if (rows <= 0) return 0;
    if (top < 1 || top > 64 || top > n) return -1;
    const bf16 *y = lm_outputs(x, rows, packed, n, k);
    if (y == NULL) return -1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (rows * n > PAR_MIN_WORK) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        if (row_cap < n) {
            free(row_logits);
            row_logits = malloc(sizeof(float) * n);
            row_cap = row_logits != NULL ? n : 0;
        }
        if (row_cap < n) {
            failed = 1;
            continue;
        }
        int64_t idx[64];
        logits_row(y + r * n, x + r * k, weight, n, k, top, row_logits, idx);
        tokens[r] = sample_logits_row(row_logits, n, temperature[r], top_k ? top_k[r] : 0, top_p ? top_p[r] : 1.0f,
                                      min_p ? min_p[r] : 0.0f, u[r]);
        failed |= tokens[r] < 0;
    }
    return failed ? -1 : 0;
}

/* Row y [w] (chunk c0 of its row) into the row's running argmax as torch's argmax over the whole row takes it: the
 * first maximum, or the first NaN (*nan, -1: none yet); *best the maximum so far at *at (-1: none yet). */
static void argmax_chunk(const float *y, int64_t w, int64_t c0, float *best, int64_t *at, int64_t *nan) {
    if (*nan >= 0) return;
    int any_nan;
    const float m = row_max(y, w, &any_nan);
    int64_t i;
    if (any_nan) {
        for (i = 0; y[i] == y[i]; i++) {}
        *nan = c0 + i;
    } else if (*at < 0 || m > *best) {
        for (i = 0; y[i] != m; i++) {}
        *best = m, *at = c0 + i;
    }
}

/* tokens[r]: the argmax of row r of linear_f32(x, packed) (x [rows, k] contiguous, n outputs, no bias) as torch's
 * argmax takes it (the first maximum; the first NaN where the row has one), the outputs made a chunk of the
 * vocabulary at a time into a scratch within L2, never whole: each output the bits linear_f32 gives it. 0 when done,
 * 1 without memory. */
int greedy_f32(const float *x, int64_t rows, const float *packed, int64_t n, int64_t k, int64_t *tokens) {
    static __thread void *buffer;
    static __thread size_t buffer_bytes;
    const int64_t panel = f32_linear_panel();
    if (rows <= 0) return 0;
    if (panel <= 0) return 1;
    const int64_t width = chunk_width(rows, sizeof(float), panel, n);
    float *scratch = grown(&buffer, &buffer_bytes, sizeof(float) * rows * width);
    if (scratch == NULL) return 1;
    char *state = malloc((sizeof(float) + 2 * sizeof(int64_t)) * rows);
    if (state == NULL) return 1;
    int64_t *at = (int64_t *)state, *nan = at + rows;
    float *best = (float *)(nan + rows);
    for (int64_t r = 0; r < rows; r++) at[r] = nan[r] = -1, best[r] = -INFINITY;
    const float *y = scratch; /* the caller's thread's: the parallel region's threads have their own */
    for (int64_t c0 = 0; c0 < n; c0 += width) {
        const int64_t w = n - c0 < width ? n - c0 : width;
        linear_f32(x, k, rows, packed + c0 * k, w, k, NULL, scratch);
#pragma omp parallel for if (rows * w > PAR_MIN_WORK)
        for (int64_t r = 0; r < rows; r++) argmax_chunk(y + r * w, w, c0, best + r, at + r, nan + r);
    }
    for (int64_t r = 0; r < rows; r++) tokens[r] = nan[r] >= 0 ? nan[r] : at[r];
    free(state);
    return 0;
}

/* The bf16 screen's bound on |bf16 output - linear_f32's output| for a row x and an output j: slope ||w_j|| with
 * slope SCREEN_SLOPE(k) ||x|| (x and w_j each rounded to bf16: 2u + u^2 of sum |x_i w_ji|, u = 2^-9, at most ||x||
 * ||w_j|| by Cauchy-Schwarz; each chain's k roundings 2.2 k 2^-24, past its 1 / (1 - k 2^-24) while k <= 2^20;
 * times 1 + 2^-10 for the bound's own float arithmetic) plus sqrt(k) 2^-126 (x's flushed denormals); plus |y_j| / 510
 * (the output's rounding to bf16: u / (1 - u)) and SCREEN_TINY (flushed products and sums, 2k 2^-126). */
#define SCREEN_U (1.0 / 512.0)
#define SCREEN_SLOPE(k) ((2.0 * SCREEN_U + SCREEN_U * SCREEN_U + 2.2 * (double)(k) / 16777216.0) * (1.0 + 1.0 / 1024.0))
#define SCREEN_OUT (1.0f / 510.0f)
#define SCREEN_TINY 1e-27f
#define SCREEN_MAX_X 1e30
#define SCREEN_MAX_K (1 << 20)
#define SCREEN_KEEP 32 /* candidates a row keeps per thread: past them the row takes greedy_f32 */

/* A thread's screen state, per row: the largest lower bound so far, and the outputs whose upper bound reaches it
 * (their ids and upper bounds, `count` of them). */
typedef struct {
    int64_t *idx, *count;
    float *floor, *upper;
} Screen;

static Screen screen_at(char *base, int64_t rows) {
    Screen s = {(int64_t *)base, NULL, NULL, NULL};
    s.count = s.idx + rows * SCREEN_KEEP;
    s.floor = (float *)(s.count + rows);
    s.upper = s.floor + rows;
    return s;
}

/* Output i (value a, bound e) into a row's kept candidates; count -1 marks a row past SCREEN_KEEP. */
static void screen_keep(float a, float e, int64_t i, float floor, float *upper, int64_t *idx, int64_t *count) {
    if (*count < 0 || a + e < floor) return;
    if (*count == SCREEN_KEEP) { /* drop those the floor has passed */
        int64_t kept = 0;
        for (int64_t j = 0; j < SCREEN_KEEP; j++)
            if (upper[j] >= floor) upper[kept] = upper[j], idx[kept++] = idx[j];
        *count = kept;
        if (kept == SCREEN_KEEP) {
            *count = -1;
            return;
        }
    }
    upper[*count] = a + e;
    idx[(*count)++] = i;
}

/* The bounds of outputs a (VW of them, or one) with norms[j] >= ||w_j|| and the row's slope s: s ||w_j|| + |a| / 510
 * + SCREEN_TINY. */
ALWAYS vf screen_bounds(vf a, const float *norms, float s) {
    return vsplat(s) * vload(norms) + (vf)((vi)a & ((vi){0} + 0x7fffffff)) * SCREEN_OUT + SCREEN_TINY;
}
ALWAYS float screen_bound(float a, float norm, float s) { return s * norm + fabsf(a) * SCREEN_OUT + SCREEN_TINY; }

/* One row's outputs y [width] (from c0) against their bounds (the row's slope s, norms [width]): the floor raised to
 * the largest lower bound, then each output whose upper bound reaches it kept. */
static void screen_scan(const bf16 *y, const float *norms, int64_t width, int64_t c0, float s, float *floor,
                        float *upper, int64_t *idx, int64_t *count) {
    vf lower = vsplat(-INFINITY);
    int64_t i = 0;
    for (; i + VW <= width; i += VW) {
        const vf a = vload_bf16(y + i), e = screen_bounds(a, norms + i, s);
        lower = vselect(a - e > lower, a - e, lower);
    }
    float f = *floor;
    for (int j = 0; j < VW; j++) f = lower[j] > f ? lower[j] : f;
    for (int64_t t = i; t < width; t++) {
        const float a = bf16_to_f(y[t]), e = screen_bound(a, norms[t], s);
        f = a - e > f ? a - e : f;
    }
    *floor = f;
    const float below = nextafterf(f, -INFINITY); /* a + e > below: a + e >= f */
    for (i = 0; i + VW <= width; i += VW) {
        const vf a = vload_bf16(y + i), e = screen_bounds(a, norms + i, s);
        if (any_above_or_nan(a + e, below))
            for (int j = 0; j < VW; j++) screen_keep(a[j], e[j], c0 + i + j, f, upper, idx, count);
    }
    for (; i < width; i++) {
        const float a = bf16_to_f(y[i]);
        screen_keep(a, screen_bound(a, norms[i], s), c0 + i, f, upper, idx, count);
    }
}

/* Output j of linear_f32 for row x, read from its panels: the same chain over k in order from zero. */
static float panel_output(const float *x, const float *packed, int64_t j, int64_t k, int64_t panel) {
    const float *w = packed + j / panel * k * panel + j % panel;
    float acc = 0.0f;
    for (int64_t i = 0; i < k; i++) acc = fmaf(x[i], w[i * panel], acc);
    return acc;
}

/* Row r's token from its candidates in every thread's lists: the first maximum of their exact outputs (an output
 * not kept has an upper bound below some lower bound, so below the row's maximum); -1 where a list overflowed. */
static int64_t screened_token(const char *lists, size_t per_thread, int64_t threads, int64_t rows, int64_t r,
                              const float *x, const float *packed, int64_t k, int64_t panel) {
    float floor = -INFINITY, best = -INFINITY;
    int64_t token = -1;
    for (int64_t t = 0; t < threads; t++) {
        const Screen st = screen_at((char *)lists + t * per_thread, rows);
        if (st.count[r] < 0) return -1;
        floor = st.floor[r] > floor ? st.floor[r] : floor;
    }
    for (int64_t t = 0; t < threads; t++) {
        const Screen st = screen_at((char *)lists + t * per_thread, rows);
        for (int64_t j = 0; j < st.count[r]; j++) {
            const int64_t i = st.idx[r * SCREEN_KEEP + j];
            if (st.upper[r * SCREEN_KEEP + j] < floor) continue;
            const float v = panel_output(x, packed, i, k, panel);
            if (token < 0 || ranks_before(v, i, best, token)) best = v, token = i;
        }
    }
    return token;
}

/* tokens[r]: greedy_f32's token for row r of fp32 x [rows, k] (contiguous), found by a bf16 screen: x rounded to
 * bf16 through the lm_head's bf16 panels `screen` (packed for linear_bf16, n outputs) a chunk of the vocabulary at
 * a time; each output's bound (SCREEN_SLOPE with the row's norm and norms[j] >= ||w_j||) leaves the outputs that
 * may be the row's maximum, whose exact outputs (panel_output on the fp32 panels `packed`) give the token. Rows
 * the screen cannot take (not finite, too large, more candidates than kept) take greedy_f32. norms: each finite.
 * 0 when done, 1 without memory. */
int greedy_f32_screened(const float *x, int64_t rows, const bf16 *screen, const float *norms, const float *packed,
                        int64_t n, int64_t k, int64_t *tokens) {
    static __thread void *buffer;
    static __thread size_t buffer_bytes;
    const int64_t panel = f32_linear_panel(), threads = omp_get_max_threads();
    if (rows <= 0) return 0;
    if (panel <= 0) return 1;
    if (k > SCREEN_MAX_K) return greedy_f32(x, rows, packed, n, k, tokens);
    const int64_t width = chunk_width(rows, sizeof(bf16), panel, n);
    /* the bf16 rows, then one chunk's outputs */
    char *base = grown(&buffer, &buffer_bytes, sizeof(bf16) * rows * (k + width));
    const size_t list_bytes = (sizeof(float) + sizeof(int64_t)) * rows * (SCREEN_KEEP + 1);
    const size_t per_thread = (list_bytes + 63) / 64 * 64;
    char *lists = malloc(per_thread * threads + (sizeof(int64_t) + sizeof(float)) * rows);
    if (base == NULL || lists == NULL) {
        free(lists);
        return 1;
    }
    bf16 *xb = (bf16 *)base, *scratch = xb + rows * k;
    int64_t *exact = (int64_t *)(lists + per_thread * threads), exact_rows = 0;
    float *slope = (float *)(exact + rows);
#pragma omp parallel for if (rows * k > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * k;
        double sum = 0.0;
        for (int64_t i = 0; i < k; i++) sum += (double)row[i] * row[i], xb[r * k + i] = f_to_bf16(row[i]);
        const double norm = sqrt(sum);
        /* a row the bound does not cover (NaN, infinite, too large) takes greedy_f32: slope NaN marks it */
        slope[r] = norm <= SCREEN_MAX_X ? nextafterf((float)(SCREEN_SLOPE(k) * norm + sqrt((double)k) * 0x1p-126),
                                                     INFINITY) : NAN;
    }
    for (int64_t t = 0; t < threads; t++) {
        const Screen st = screen_at(lists + t * per_thread, rows);
        for (int64_t r = 0; r < rows; r++) st.floor[r] = -INFINITY, st.count[r] = 0;
    }
    for (int64_t c0 = 0; c0 < n; c0 += width) {
        const int64_t w = n - c0 < width ? n - c0 : width, panels = (w + panel - 1) / panel;
        if (linear_bf16(xb, rows, screen + c0 * k, w, k, NULL, scratch)) {
            free(lists);
            return 1;
        }
        const bf16 *y = scratch; /* the caller's thread's: the parallel region's threads have their own */
#pragma omp parallel if (rows * w > PAR_MIN_WORK)
        {
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            const int64_t lo = panels * me / team * panel, hi_panel = panels * (me + 1) / team * panel;
            const int64_t hi = hi_panel < w ? hi_panel : w;
            const Screen st = screen_at(lists + me * per_thread, rows);
            for (int64_t r = 0; r < rows && lo < hi; r++)
                if (slope[r] == slope[r])
                    screen_scan(y + r * w + lo, norms + c0 + lo, hi - lo, c0 + lo, slope[r], st.floor + r,
                                st.upper + r * SCREEN_KEEP, st.idx + r * SCREEN_KEEP, st.count + r);
        }
    }
#pragma omp parallel for schedule(dynamic, 4) if (rows * k > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++)
        tokens[r] = slope[r] == slope[r] ? screened_token(lists, per_thread, threads, rows, r, x + r * k, packed, k,
                                                          panel) : -1;
    for (int64_t r = 0; r < rows; r++)
        if (tokens[r] < 0) exact[exact_rows++] = r;
    int status = 0;
    if (exact_rows) { /* those rows gathered, through greedy_f32 (a row's outputs never depend on the others) */
        float *gathered = malloc(sizeof(float) * exact_rows * k);
        int64_t *got = malloc(sizeof(int64_t) * exact_rows);
        status = gathered == NULL || got == NULL;
        for (int64_t i = 0; !status && i < exact_rows; i++)
            memcpy(gathered + i * k, x + exact[i] * k, sizeof(float) * k);
        status = status || greedy_f32(gathered, exact_rows, packed, n, k, got);
        for (int64_t i = 0; !status && i < exact_rows; i++) tokens[exact[i]] = got[i];
        free(gathered);
        free(got);
    }
    free(lists);
    return status;
}
