/* The fused element-wise ops of a decoder layer, each one pass with torch's intermediate bf16 roundings; rows are
 * shared out to the threads in contiguous runs. */
#include "common.h"

/* This thread's share [r0, r1) of `rows` rows (OpenMP's static schedule). */
static void thread_rows(int64_t rows, int64_t *r0, int64_t *r1) {
    const int64_t n = omp_get_num_threads(), i = omp_get_thread_num(), per = rows / n, extra = rows % n;
    *r0 = i * per + (i < extra ? i : extra);
    *r1 = *r0 + per + (i < extra);
}

/* out = weight * rmsnorm(h), h = x + residual (written back to residual) when add, else x. In bf16 the norm is
 * of the stored h and rounded before the weight multiplies it, as transformers; res_fp32: h stays fp32. */
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

/* residual += x, and out = the sum rounded to x's dtype: torch's `h = residual + x` then `h.to(x.dtype)` (res_fp32:
 * an fp32 residual beside bf16 activations). */
ALWAYS void add_residual_impl(const void *x, void *residual, void *out, int64_t r0, int64_t r1, int64_t dim,
                              const int res_fp32, const int bf) {
    const int hb = bf && !res_fp32;
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = at(x, r * dim, bf);
        void *hr = (void *)at(residual, r * dim, hb), *orow = (void *)at(out, r * dim, bf);
        int64_t i = 0;
        for (; i + VW <= dim; i += VW) {
            const vf h = rnd(ldv(hr, i, hb) + ldv(xr, i, bf), hb);
            stv(hr, i, h, hb);
            stv(orow, i, h, bf);
        }
        for (; i < dim; i++) {
            const float h = rnd1(ld1(hr, i, hb) + ld1(xr, i, bf), hb);
            st1(hr, i, h, hb);
            st1(orow, i, h, bf);
        }
    }
}
ALWAYS void add_residual_res(const void *x, void *residual, void *out, int64_t r0, int64_t r1, int64_t dim,
                             int res_fp32, const int bf) {
    if (res_fp32)
        add_residual_impl(x, residual, out, r0, r1, dim, 1, bf);
    else
        add_residual_impl(x, residual, out, r0, r1, dim, 0, bf);
}

void add_residual(const void *x, void *residual, void *out, int64_t rows, int64_t dim, int res_fp32, int bf) {
#pragma omp parallel if (rows * dim > PAR_MIN_WORK)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        BY_DTYPE(bf, add_residual_res, x, residual, out, r0, r1, dim, res_fp32);
    }
}

/* out [tokens, heads, dim] = weight * rmsnorm of each head's row, token t's heads read at x + t * stride (a q or k
 * slice of a fused projection, in place); each row as rms_norm computes it. */
void rms_norm_heads(const void *x, int64_t stride, const void *weight, void *out, int64_t tokens, int64_t heads,
                    int64_t dim, float eps, int bf) {
#pragma omp parallel if (tokens * heads * dim > PAR_MIN_WORK)
    {
        int64_t t0, t1;
        thread_rows(tokens, &t0, &t1);
        for (int64_t t = t0; t < t1; t++)
            BY_DTYPE(bf, rms_norm_res, at(x, t * stride, bf), NULL, weight, (void *)at(out, t * heads * dim, bf), 0,
                     heads, dim, eps, 0, 0);
    }
}

/* out[r, i] = silu(gate) * up over [rows, 2 * inter] (gate | up); silu rounded to bf16 first, as torch's two ops. */
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

/* gelu_tanh(gate) * up (GeGLU): 0.5 x (1 + tanh(y)) taken as x / (1 + exp(-2y)), without 1 + tanh's cancellation.
 * Every element goes through the same vector code (tails padded), so a row's bits do not depend on its batch. */
ALWAYS vf gelu_tanh_v(vf x) {
    const vf y = (x + x * x * x * 0.044715f) * 0.7978845608028654f;
    return x / (1.0f + exp_v(y * -2.0f));
}

ALWAYS void gelu_tanh_mul_impl(const void *gu, void *out, int64_t r0, int64_t r1, int64_t inter, const int bf) {
    for (int64_t r = r0; r < r1; r++) {
        const void *g = at(gu, r * 2 * inter, bf), *u = at(g, inter, bf);
        void *o = (void *)at(out, r * inter, bf);
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) stv(o, i, rnd(gelu_tanh_v(ldv(g, i, bf)), bf) * ldv(u, i, bf), bf);
        if (i < inter) {
            float x[VW] = {0}, y[VW];
            for (int64_t j = 0; i + j < inter; j++) x[j] = ld1(g, i + j, bf);
            const vf gx = gelu_tanh_v(vload(x));
            memcpy(y, &gx, sizeof y);
            for (int64_t j = 0; i + j < inter; j++) st1(o, i + j, rnd1(y[j], bf) * ld1(u, i + j, bf), bf);
        }
    }
}

void gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf) {
#pragma omp parallel if (rows * inter > PAR_MIN_WORK)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        BY_DTYPE(bf, gelu_tanh_mul_impl, gu, out, r0, r1, inter);
    }
}

/* x = cap * tanh(x / cap) in place (Gemma 2's logit soft-capping), every value through the same vector code. */
ALWAYS vf tanh_cap_v(vf x, float cap) {
    const vf z = x / cap;
    const vi negative = z < 0.0f;
    const vf e = exp_v(vselect(negative, z, -z) * 2.0f); /* exp(-2|z|) */
    const vf t = (1.0f - e) / (1.0f + e);
    return vselect(negative, -t, t) * cap;
}

void tanh_cap(float *x, int64_t n, float cap) {
    const int64_t chunks = (n + VW - 1) / VW;
#pragma omp parallel for if (n > PAR_MIN_WORK)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i = c * VW;
        if (i + VW <= n) {
            vstore(x + i, tanh_cap_v(vload(x + i), cap));
        } else {
            float buf[VW] = {0};
            memcpy(buf, x + i, sizeof(float) * (n - i));
            const vf t = tanh_cap_v(vload(buf), cap);
            memcpy(buf, &t, sizeof buf);
            memcpy(x + i, buf, sizeof(float) * (n - i));
        }
    }
}

/* Rotary embedding in place on the first `heads` heads of each row (rows `stride` apart): the two halves of each
 * head's first `rot` dims rotated by the position's fp32 cos / sin rows [max_pos, rot], rounded once. */
ALWAYS void rope_impl(void *x, int64_t stride, int64_t r0, int64_t r1, int64_t heads, int64_t d, int64_t rot,
                      const int64_t *positions, const float *cos_t, const float *sin_t, const int bf) {
    const int64_t half = rot / 2;
    for (int64_t r = r0; r < r1; r++) {
        const float *c = cos_t + positions[r] * rot, *s = sin_t + positions[r] * rot;
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

void rope(void *x, int64_t stride, int64_t rows, int64_t heads, int64_t d, int64_t rot, const int64_t *positions,
          const float *cos_t, const float *sin_t, int bf) {
#pragma omp parallel if (rows * heads * d > PAR_MIN_WORK)
    {
        int64_t r0, r1;
        thread_rows(rows, &r0, &r1);
        BY_DTYPE(bf, rope_impl, x, stride, r0, r1, heads, d, rot, positions, cos_t, sin_t);
    }
}
