/* A sparse mixture-of-experts block's own arithmetic (arch/moe.py), shared by the Python path and the native call
 * (decoder.c) so both give one set of bits: the router's choice of experts and the weighted sum of their outputs.
 * A row's result depends on that row only. */
#include "common.h"

/* v, with the compiler unable to see its value: a product kept from fusing into the next add (-ffp-contract=fast),
 * so that each term is rounded on its own, as torch rounds it. */
ALWAYS vf opaque_v(vf v) {
#if defined(__x86_64__)
    __asm__("" : "+v"(v));
#endif
    return v;
}
ALWAYS float opaque1(float x) {
#if defined(__x86_64__)
    __asm__("" : "+x"(x));
#endif
    return x;
}

ALWAYS void route_row(const void *logits, int64_t experts, int64_t top_k, int normalize, float *weights,
                      int64_t *chosen, const int bf) {
    float p[experts];
    char taken[experts];
    float m = ld1(logits, 0, bf);
    for (int64_t i = 0; i < experts; i++) {
        p[i] = ld1(logits, i, bf);
        m = p[i] > m ? p[i] : m;
        taken[i] = 0;
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < experts; i += VW) {
        const int64_t n = experts - i < VW ? experts - i : VW;
        exp_tail(p + i, p + i, n, m, 1.0f);
        for (int64_t j = 0; j < n; j++) sum += p[i + j];
    }
    for (int64_t i = 0; i < experts; i++) p[i] /= sum;
    float total = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < experts; i++)
            if (!taken[i] && (best < 0 || ranks_before(p[i], i, p[best], best))) best = i;
        taken[best] = 1;
        chosen[j] = best;
        weights[j] = p[best];
        total += p[best];
    }
    if (normalize)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= total;
}

/* Each row's top_k experts of `experts` router logits [rows, experts] (fp32 or bf16): the softmax in fp32, the
 * largest probabilities first (of equal ones the lower expert), divided by their sum where `normalize`. */
void moe_route(const void *logits, int64_t rows, int64_t experts, int64_t top_k, int normalize, int bf,
               float *weights, int64_t *chosen) {
#pragma omp parallel for if (rows * experts > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++)
        BY_DTYPE(bf, route_row, at(logits, r * experts, bf), experts, top_k, normalize, weights + r * top_k,
                 chosen + r * top_k);
}

ALWAYS void combine_row(const void *outputs, const int64_t *where, const float *weights, const int64_t *chosen,
                        int64_t r, int64_t top_k, int64_t hidden, void *out, const int bf) {
    int64_t order[top_k]; /* the row's pairs by ascending expert */
    for (int64_t j = 0; j < top_k; j++) {
        int64_t at_j = j;
        while (at_j > 0 && chosen[r * top_k + order[at_j - 1]] > chosen[r * top_k + j]) {
            order[at_j] = order[at_j - 1];
            at_j--;
        }
        order[at_j] = j;
    }
    void *o = (void *)at(out, r * hidden, bf);
    for (int64_t n = 0; n < top_k; n++) {
        const int64_t pair = r * top_k + order[n];
        const void *x = at(outputs, (where ? where[pair] : pair) * hidden, bf);
        const float w = weights[pair];
        int64_t i = 0;
        for (; i + VW <= hidden; i += VW) {
            const vf term = rnd(opaque_v(ldv(x, i, bf) * w), bf);
            stv(o, i, n ? ldv(o, i, bf) + term : term, bf);
        }
        for (; i < hidden; i++) {
            const float term = rnd1(opaque1(ld1(x, i, bf) * w), bf);
            st1(o, i, n ? ld1(o, i, bf) + term : term, bf);
        }
    }
}

/* out[r] = the sum over the row's pairs, in ascending expert order, of outputs[pair] * weights[pair], each product
 * rounded to the dtype and each sum too (transformers' order); pair = r * top_k + j, its output row where[pair]
 * (NULL: pair). */
void moe_combine(const void *outputs, const int64_t *where, const float *weights, const int64_t *chosen, int64_t rows,
                 int64_t top_k, int64_t hidden, void *out, int bf) {
#pragma omp parallel for if (rows * top_k * hidden > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++)
        BY_DTYPE(bf, combine_row, outputs, where, weights, chosen, r, top_k, hidden, out);
}

ALWAYS void add_shared_row(void *out, const void *shared, const void *gate_logits, int64_t r, int64_t hidden,
                           const int bf) {
    /* the sigmoid in double, to float, to the dtype: torch's sigmoid(x.double()).to(dtype) */
    const double z = (double)ld1(gate_logits, r, bf);
    const float g = rnd1((float)(1.0 / (1.0 + exp(-z))), bf);
    void *o = (void *)at(out, r * hidden, bf);
    const void *s = at(shared, r * hidden, bf);
    int64_t i = 0;
    for (; i + VW <= hidden; i += VW) stv(o, i, ldv(o, i, bf) + rnd(opaque_v(ldv(s, i, bf) * g), bf), bf);
    for (; i < hidden; i++) st1(o, i, ld1(o, i, bf) + rnd1(opaque1(ld1(s, i, bf) * g), bf), bf);
}

/* out[r] += sigmoid(gate_logits[r]) * shared[r] (Qwen2-MoE's gated shared expert, out and shared [rows, hidden],
 * gate_logits [rows]): the sigmoid in double rounded to the dtype, then the product and the sum each rounded to it,
 * as the torch reference rounds them. */
void moe_add_shared(void *out, const void *shared, const void *gate_logits, int64_t rows, int64_t hidden, int bf) {
#pragma omp parallel for if (rows * hidden > PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) BY_DTYPE(bf, add_shared_row, out, shared, gate_logits, r, hidden);
}
