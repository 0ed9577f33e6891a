/* Kernels on a step's logits, between the model's last layer and the sampler: logits_top (bf16 logits widened
 * to fp32, each row's top k found in the same pass) and apply_token_bitmask (structured outputs' grammar mask).
 * Sampling kernels belong here too, with their ctypes wrappers in cpu_kernels/sampling.py.
 *
 * Layout: logits [rows, vocab] (logits_top: contiguous; apply_token_bitmask: fp32 rows `stride` floats apart);
 * the bitmask int32 [rows, words] in xgrammar's layout (bit t % 32 of word t / 32 is token t).
 *
 * Threads: a parallel for over rows, above PAR_MIN_WORK elements (the bitmask: 16 times that). */
#include "common.h"

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
