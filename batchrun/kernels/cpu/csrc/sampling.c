/* Kernels on a step's logits: logits_top, apply_token_bitmask (the grammar's mask), sample_rows; rows in parallel. */
#include "common.h"

/* ---- bf16 logits ------------------------------------------------------------------------------------ */

/* Whether kept entry j is evicted before entry lo: lo ranks before it. */
static inline int evicts_before(const float *val, const int64_t *idx, int64_t j, int64_t lo) {
    return ranks_before(val[lo], idx[lo], val[j], idx[j]);
}

/* o = one row of bf16 logits x widened to fp32, idx[0..k) the indices of its k <= 64 largest (ties the earlier), by
 * value descending then index, found in the same pass: mostly one vector compare against the smallest kept. */
void logits_top_row(const bf16 *x, float *o, int64_t vocab, int64_t k, int64_t *idx) {
    float val[64];
    int64_t kk = k < vocab ? k : vocab, lo = 0;
    for (int64_t j = 0; j < kk; j++) {
        val[j] = o[j] = bf16_to_f(x[j]);
        idx[j] = j;
    }
    for (int64_t j = 1; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
    int64_t i = kk;
    for (; i < vocab; i++) { /* up to a multiple of VW */
        if (i % VW == 0) break;
        const float v = o[i] = bf16_to_f(x[i]);
        if (v > val[lo]) {
            val[lo] = v, idx[lo] = i;
            for (int64_t j = 0; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
        }
    }
    for (; i + VW <= vocab; i += VW) {
        const vf v = vload_bf16(x + i);
        vstore(o + i, v);
        if (!any_above_or_nan(v, val[lo])) continue; /* a NaN never goes in: the lane loop passes it */
        for (int64_t t = i; t < i + VW; t++) {
            if (o[t] > val[lo]) {
                val[lo] = o[t], idx[lo] = t;
                for (int64_t j = 0; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
            }
        }
    }
    for (; i < vocab; i++) {
        const float v = o[i] = bf16_to_f(x[i]);
        if (v > val[lo]) {
            val[lo] = v, idx[lo] = i;
            for (int64_t j = 0; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
        }
    }
    for (int64_t j = 1; j < kk; j++) /* in the rows' order (ranks_before) */
        for (int64_t i = j; i > 0 && evicts_before(val, idx, i - 1, i); i--) {
            const float v = val[i];
            const int64_t t = idx[i];
            val[i] = val[i - 1], idx[i] = idx[i - 1];
            val[i - 1] = v, idx[i - 1] = t;
        }
    for (int64_t j = kk; j < k; j++) idx[j] = idx[0]; /* vocab < k: repeat a kept index */
}

/* out = bf16 logits [rows, vocab] widened to fp32, top [rows, k] each row's logits_top_row. */
void logits_top(const bf16 *in, float *out, int64_t rows, int64_t vocab, int64_t k, int64_t *top) {
#pragma omp parallel for if (rows * vocab > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) logits_top_row(in + r * vocab, out + r * vocab, vocab, k, top + r * k);
}

/* ---- structured outputs' token mask ----------------------------------------------------------------- */

/* logits[r, t] = -inf where bit t % 32 of bitmask[r, t / 32] is 0, for the listed rows (xgrammar's layout and
 * result); a word with every bit set is skipped. */
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

/* ---- sampling: one token per row without sorting the vocabulary ---------------------------------------- */

/* A sampled row keeps {i : e_i >= max(t_k, t_p, t_m)}, e_i = exp((x_i - max x) / T): t_k the k-th largest e,
 * t_p the largest t whose mass sum(e_i >= t) reaches top_p x top-k's, t_m = min_p. Each is found exactly by radix
 * selection on e's bits, over the candidates e_i >= CANDIDATE when they hold it, else lower floors or the row.
 * The draw walks the kept ids in order with a double running sum to u x their mass: batch invariant. */
#define CANDIDATE 0x1p-16f
/* the floors tried in turn when the candidates do not hold the kept set, then the whole row */
static const float LOWER_FLOORS[] = {0x1p-24f, 0x1p-32f, 0.0f};
#define DRAW_BLOCK (4 * VW) /* ids per block of the draw's running sum over a whole row */
#define RADIX 2048 /* digits of 10, 10 and 11 bits: a non-negative float's 31 bits */

ALWAYS uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }
ALWAYS float bitsf(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }

/* The largest t among e[idx[0..n)] (> 0) with sum_{e_i >= t} w_i >= target, w_i = e_i (by_mass) or 1; when
 * rounding leaves the whole set short, the smallest. tmp holds n indices. */
static float select_threshold(const float *e, const int32_t *idx, int64_t n, double target, int by_mass,
                              int32_t *tmp) {
    static const int shift[3] = {21, 11, 0};
    static const uint32_t digit[3] = {1023, 1023, 2047};
    double weight[RADIX];
    const int32_t *members = idx;
    double above = 0.0; /* the weight above the current bucket */
    uint32_t prefix = 0;
    for (int level = 0; level < 3; level++) {
        const int s = shift[level];
        memset(weight, 0, sizeof(double) * (digit[level] + 1));
        for (int64_t j = 0; j < n; j++) {
            const float v = e[members[j]];
            weight[(fbits(v) >> s) & digit[level]] += by_mass ? (double)v : 1.0;
        }
        int b = (int)digit[level], last = -1;
        for (; b >= 0; b--) {
            if (weight[b] == 0.0) continue;
            last = b;
            if (above + weight[b] >= target) break;
            above += weight[b];
        }
        if (b < 0) { /* short by rounding: the lowest nonempty bucket */
            b = last;
            above -= weight[b];
        }
        prefix |= (uint32_t)b << s;
        if (level == 2) break;
        int64_t m = 0; /* the boundary bucket's members, for the next digit */
        for (int64_t j = 0; j < n; j++)
            if (((fbits(e[members[j]]) >> s) & digit[level]) == (uint32_t)b) tmp[m++] = members[j];
        members = tmp, n = m; /* rewritten in place at the next level: it only shrinks */
    }
    return bitsf(prefix);
}

typedef struct {
    float *e;
    int32_t *idx, *tmp;
    double *blocks; /* the kept mass of each DRAW_BLOCK ids */
    int64_t cap;
} SampleScratch;

static __thread SampleScratch sample_scratch;

static int sample_buffers(int64_t vocab) {
    SampleScratch *s = &sample_scratch;
    if (s->cap >= vocab) return 0;
    free(s->e), free(s->idx), free(s->tmp), free(s->blocks);
    s->e = malloc(sizeof(float) * (vocab + VW));
    s->idx = malloc(sizeof(int32_t) * (vocab + VW));
    s->tmp = malloc(sizeof(int32_t) * vocab);
    s->blocks = malloc(sizeof(double) * (vocab / DRAW_BLOCK + 1));
    s->cap = (s->e && s->idx && s->tmp && s->blocks) ? vocab : 0;
    return s->cap ? 0 : 1;
}

/* The ids of e's values >= lo (> 0 when lo is 0) into idx (vocab + VW entries), in order; their count. */
static int64_t collect_at_least(const float *e, int64_t vocab, float lo, int32_t *idx) {
    const float floor = lo > 0.0f ? lo : 0x1p-149f;
    int64_t n = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 f = _mm512_set1_ps(floor);
    const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 16 <= vocab; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + i), f, _CMP_GE_OQ);
        if (hit) {
            const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32((int)i), step);
            _mm512_storeu_si512(idx + n, _mm512_maskz_compress_epi32(hit, ids));
            n += __builtin_popcount(hit);
        }
    }
#endif
    for (; i < vocab; i++)
        if (e[i] >= floor) idx[n++] = (int32_t)i;
    return n;
}

/* The token drawn from weights e (>= 0, largest emax); idx[0..ncand): the e_i >= CANDIDATE x emax when `select`
 * (top-k or top-p on); total: the row's mass. *threshold: the kept set's (0: every e_i > 0). */
static int64_t draw_kept(const float *e, int64_t vocab, float emax, int32_t *idx, int64_t ncand, double total,
                         int select, int64_t top_k, float top_p, float min_p, double u, float *threshold) {
    SampleScratch *s = &sample_scratch;
    float t = 0.0f;
    double cand_mass = 0.0;
    for (int64_t j = 0; j < ncand; j++) cand_mass += e[idx[j]];
    if (select) {
        double mass = total;
        if (top_k > 0 && top_k < vocab) {
            /* the k-th largest lies below the candidates: a lower floor, else the whole row */
            for (int f = 0; f < 3 && ncand < top_k; f++)
                ncand = collect_at_least(e, vocab, LOWER_FLOORS[f] * emax, idx);
            t = select_threshold(e, idx, ncand, (double)top_k, 0, s->tmp);
            mass = 0.0;
            int64_t kept = 0;
            for (int64_t j = 0; j < ncand; j++)
                if (e[idx[j]] >= t) idx[kept++] = idx[j], mass += e[idx[j]];
            ncand = kept, cand_mass = mass;
        }
        if (top_p < 1.0f) {
            const double target = (double)top_p * mass;
            for (int f = 0; f < 3 && cand_mass < target; f++) { /* too little mass: a lower floor, else all */
                ncand = collect_at_least(e, vocab, LOWER_FLOORS[f] * emax, idx);
                cand_mass = 0.0;
                for (int64_t j = 0; j < ncand; j++) cand_mass += e[idx[j]];
            }
            const float tp = select_threshold(e, idx, ncand, target, 1, s->tmp);
            t = tp > t ? tp : t;
        }
    }
    const float tm = min_p * emax;
    if (min_p > 0.0f && tm > t) t = tm;
    *threshold = t;
    /* the draw over the kept ids in order; with a filter on, the candidates hold them */
    double kept_mass = 0.0, run = 0.0;
    int64_t last = -1;
    if (select) {
        for (int64_t j = 0; j < ncand; j++) if (e[idx[j]] >= t) kept_mass += e[idx[j]];
        const double target = u * kept_mass;
        for (int64_t j = 0; j < ncand; j++) {
            const float v = e[idx[j]];
            if (v < t) continue;
            run += v, last = idx[j];
            if (run > target) return last;
        }
        return last < 0 ? 0 : last; /* no mass at all: only a test's weights */
    }
    /* the whole row: each block's kept mass, then the walk inside one block */
    const vf tv = vsplat(t > 0.0f ? t : 0x1p-149f);
    const int64_t nblocks = vocab / DRAW_BLOCK;
    for (int64_t b = 0; b < nblocks; b++) {
        const float *eb = e + b * DRAW_BLOCK;
        vf a = {0};
        for (int j = 0; j < DRAW_BLOCK; j += VW) {
            const vf v = vload(eb + j);
            a += vselect(v >= tv, v, vsplat(0.0f));
        }
        kept_mass += s->blocks[b] = hsum(a);
    }
    for (int64_t i = nblocks * DRAW_BLOCK; i < vocab; i++) if (e[i] >= tv[0]) kept_mass += e[i];
    const double target = u * kept_mass;
    int64_t i = 0;
    for (int64_t b = 0; b < nblocks && run + s->blocks[b] <= target; b++) run += s->blocks[b], i += DRAW_BLOCK;
    for (; i < vocab; i++) {
        if (e[i] < tv[0]) continue;
        run += e[i], last = i;
        if (run > target) return last;
    }
    /* rounding left the walk short: the last kept id */
    for (i = vocab - 1; i >= 0; i--) if (e[i] >= tv[0]) return i;
    return 0;
}

/* One row's token (T = 0: the first maximum, or the first NaN, as torch's argmax). */
static int64_t sample_row(const float *x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          double u, float *threshold) {
    int any_nan;
    const float m = row_max(x, vocab, &any_nan);
    int64_t i;
    *threshold = 0.0f;
    if (temperature <= 0.0f || m == -INFINITY || any_nan) {
        for (i = 0; i < vocab; i++)
            if (x[i] == m || x[i] != x[i]) return i;
        return 0;
    }
    SampleScratch *s = &sample_scratch;
    float *e = s->e;
    int32_t *idx = s->idx;
    const int select = (top_k > 0 && top_k < vocab) || top_p < 1.0f;
    const float inv_t = 1.0f / temperature;
    int64_t ncand = 0;
    vf acc = {0};
    const vf ninf = vsplat(-INFINITY), zero = vsplat(0.0f), cand = vsplat(CANDIDATE);
#if defined(__AVX512F__)
    const __m512i step = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
    for (i = 0; i + VW <= vocab; i += VW) {
        const vf v = vload(x + i);
        const vf ev = vselect(v == ninf, zero, exp_v((v - m) * inv_t)); /* masked tokens: no mass */
        vstore(e + i, ev);
        acc += ev;
        if (select) {
#if defined(__AVX512F__)
            const __mmask16 hit = _mm512_cmp_ps_mask((__m512)ev, (__m512)cand, _CMP_GE_OQ);
            if (hit) {
                const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32((int)i), step);
                /* compress, then a plain store (a compressing store is microcoded on Zen 4; idx has VW spare) */
                _mm512_storeu_si512(idx + ncand, _mm512_maskz_compress_epi32(hit, ids));
                ncand += __builtin_popcount(hit);
            }
#else
            const vi hit = ev >= cand;
            int any = 0;
            for (int j = 0; j < VW; j++) any |= hit[j];
            if (any)
                for (int j = 0; j < VW; j++)
                    if (hit[j]) idx[ncand++] = (int32_t)(i + j);
#endif
        }
    }
    double total = hsum(acc);
    if (i < vocab) {
        exp_tail(x + i, e + i, vocab - i, m, inv_t);
        for (; i < vocab; i++) {
            if (x[i] == -INFINITY) e[i] = 0.0f;
            total += e[i];
            if (select && e[i] >= CANDIDATE) idx[ncand++] = (int32_t)i;
        }
    }
    return draw_kept(e, vocab, 1.0f, idx, ncand, total, select, top_k, top_p, min_p, u, threshold);
}

/* One row of fp32 logits drawn as sample_rows draws it: its token, or -1 when the thread could not get its buffers. */
int64_t sample_logits_row(const float *x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          double u) {
    float t;
    return sample_buffers(vocab) ? -1 : sample_row(x, vocab, temperature, top_k, top_p, min_p, u, &t);
}

/* draw_kept on given weights w >= 0, for tests. */
int sample_weights(const float *w, int64_t rows, int64_t vocab, const int64_t *top_k, const float *top_p,
                   const float *min_p, const double *u, int64_t *out, float *threshold) {
    for (int64_t r = 0; r < rows; r++) {
        if (sample_buffers(vocab)) return 1;
        const float *e = w + r * vocab;
        const int select = (top_k[r] > 0 && top_k[r] < vocab) || top_p[r] < 1.0f;
        float emax = 0.0f;
        double total = 0.0;
        for (int64_t i = 0; i < vocab; i++) emax = e[i] > emax ? e[i] : emax, total += e[i];
        int64_t ncand = 0;
        for (int64_t i = 0; i < vocab && select; i++)
            if (e[i] >= CANDIDATE * emax && e[i] > 0.0f) sample_scratch.idx[ncand++] = (int32_t)i;
        out[r] = draw_kept(e, vocab, emax, sample_scratch.idx, ncand, total, select, top_k[r], top_p[r],
                           min_p[r], u[r], threshold + r);
    }
    return 0;
}

/* out[r] = row r's token: temperature 0 greedy; top_k <= 0, top_p >= 1, min_p <= 0 (or NULL: every row) turn a
 * filter off; u[r] in [0, 1). Rows shared out dynamically; 1 when a thread could not get its buffers. */
int sample_rows(const float *logits, int64_t stride, int64_t rows, int64_t vocab, const float *temperature,
                const int64_t *top_k, const float *top_p, const float *min_p, const double *u, int64_t *out) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (rows * vocab > PAR_MIN_WORK) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = sample_logits_row(logits + r * stride, vocab, temperature[r], top_k ? top_k[r] : 0,
                                   top_p ? top_p[r] : 1.0f, min_p ? min_p[r] : 0.0f, u[r]);
        failed |= out[r] < 0;
    }
    return failed;
}

/* ---- scores of given tokens: logprobs and prompt logprobs ---------------------------------------------- */

/* val / idx: the kk largest of x, of equal values the smaller ids (kept unordered). */
static void keep_top(const float *x, int64_t vocab, int64_t kk, float *val, int64_t *idx) {
    int64_t lo = 0;
    for (int64_t j = 0; j < kk; j++) val[j] = x[j], idx[j] = j;
    for (int64_t j = 1; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
    int64_t i = kk;
    for (; i < vocab && i % VW; i++)
        if (x[i] > val[lo]) {
            val[lo] = x[i], idx[lo] = i;
            for (int64_t j = 0; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
        }
    for (; i < vocab; i += VW) {
        const int64_t end = i + VW <= vocab ? i + VW : vocab;
        if (end == i + VW && !any_above_or_nan(vload(x + i), val[lo])) continue;
        for (int64_t t = i; t < end; t++)
            if (x[t] > val[lo]) {
                val[lo] = x[t], idx[lo] = t;
                for (int64_t j = 0; j < kk; j++) lo = evicts_before(val, idx, j, lo) ? j : lo;
            }
    }
}

/* Row r of fp32 logits scored for targets[r]: logprob = (x_t - m) - log sum exp(x - m) (m the row's max), rank =
 * 1 + #{i : x_i > x_t}, and the row's k <= 64 largest as log-probs with their ids, largest first (ties: the
 * smaller id first). Per row: one pass for the max and the count, one for the sum, one for the top k. */
void score_rows(const float *logits, int64_t stride, int64_t rows, int64_t vocab, const int64_t *targets, int64_t k,
                float *logprob, int64_t *rank, float *top_lp, int64_t *top_ids) {
#pragma omp parallel for if (rows * vocab > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * stride;
        const float xt = x[targets[r]];
        vf vmax = vsplat(-INFINITY);
        vi above = {0};
        int64_t i = 0, count = 0;
        for (; i + VW <= vocab; i += VW) {
            const vf v = vload(x + i);
            vmax = vselect(v > vmax, v, vmax);
            above -= v > vsplat(xt); /* a true lane is -1 */
        }
        float m = -INFINITY;
        for (int j = 0; j < VW; j++) m = vmax[j] > m ? vmax[j] : m, count += above[j];
        for (; i < vocab; i++) m = x[i] > m ? x[i] : m, count += x[i] > xt;
        vf acc0 = {0}, acc1 = {0};
        for (i = 0; i + 2 * VW <= vocab; i += 2 * VW) {
            acc0 += exp_v(vload(x + i) - m);
            acc1 += exp_v(vload(x + i + VW) - m);
        }
        float tail[2 * VW];
        double sum = (double)hsum(acc0) + hsum(acc1);
        if (i < vocab) {
            for (int64_t at = i; at < vocab; at += VW) {
                const int64_t n = vocab - at < VW ? vocab - at : VW;
                exp_tail(x + at, tail, n, m, 1.0f);
                for (int64_t j = 0; j < n; j++) sum += tail[j];
            }
        }
        const float log_sum = (float)log(sum);
        logprob[r] = (xt - m) - log_sum;
        rank[r] = 1 + count;
        const int64_t kk = k < vocab ? k : vocab;
        if (kk <= 0) continue;
        float val[64];
        int64_t idx[64];
        keep_top(x, vocab, kk, val, idx);
        for (int64_t a = 1; a < kk; a++) /* insertion sort: larger first, then the smaller id */
            for (int64_t b = a; b > 0 && (val[b] > val[b - 1] || (val[b] == val[b - 1] && idx[b] < idx[b - 1])); b--) {
                const float tv = val[b];
                const int64_t ti = idx[b];
                val[b] = val[b - 1], idx[b] = idx[b - 1], val[b - 1] = tv, idx[b - 1] = ti;
            }
        for (int64_t j = 0; j < k; j++) {
            top_lp[r * k + j] = (val[j < kk ? j : kk - 1] - m) - log_sum;
            top_ids[r * k + j] = idx[j < kk ? j : kk - 1];
        }
    }
}
