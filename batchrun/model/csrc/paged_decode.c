/* Paged decode attention for CPUs, fp32: each sequence's K and V are read once, straight from the
 * block-table-addressed pool, with no gathered copy. Two halves around a softmax done by torch:
 *   paged_qk: scores[s, hq, t] = scale * q[s, hq] . K_s[t]   (-inf past the sequence's length)
 *   paged_pv: out[s, hq]       = sum_t p[s, hq, t] * V_s[t]
 * A task is one sequence: token by token it reads the K (or V) rows of all kv heads, which sit together
 * in the pool, and uses each for all query heads of its GQA group, so every byte is loaded once.
 * Sequences are spread over OpenMP threads; loaded after torch, the library binds to torch's own OpenMP
 * runtime (the same libgomp.so.1), so it shares torch's thread pool instead of adding threads to it.
 * Pool layout of one layer: [num_blocks, block_size, num_kv_heads, head_dim] for K, the same for V. */
#include <math.h>
#include <stdint.h>

static inline const float *row(const float *pool, const int32_t *table, int64_t t, int64_t bs,
                               int64_t hkv, int64_t d) {
    return pool + ((int64_t)table[t / bs] * bs + t % bs) * hkv * d;
}

void paged_qk(const float *q, const float *k, const int32_t *bt, int64_t bt_stride, const int32_t *lens,
              float *scores, int64_t ctx, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,
              int64_t num_seqs) {
    const int64_t g = hq / hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t n = lens[s];
        const float *qs = q + s * hq * d;
        float *sc = scores + s * hq * ctx;
        const int32_t *table = bt + s * bt_stride;
        for (int64_t t = 0; t < n; t++) {
            const float *kt = row(k, table, t, bs, hkv, d);
            for (int64_t j = 0; j < hq; j++) {  /* query head j reads kv head j / g */
                const float *qj = qs + j * d, *kj = kt + (j / g) * d;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < d; i++) acc += qj[i] * kj[i];
                sc[j * ctx + t] = acc * scale;
            }
        }
        for (int64_t j = 0; j < hq; j++)
            for (int64_t t = n; t < ctx; t++) sc[j * ctx + t] = -INFINITY;
    }
}

void paged_pv(const float *p, const float *v, const int32_t *bt, int64_t bt_stride, const int32_t *lens,
              float *out, int64_t ctx, int64_t hq, int64_t hkv, int64_t d, int64_t bs, int64_t num_seqs) {
    const int64_t g = hq / hkv;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t n = lens[s];
        const float *ps = p + s * hq * ctx;
        float *os = out + s * hq * d;
        const int32_t *table = bt + s * bt_stride;
        for (int64_t i = 0; i < hq * d; i++) os[i] = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float *vt = row(v, table, t, bs, hkv, d);
            for (int64_t j = 0; j < hq; j++) {
                const float w = ps[j * ctx + t], *vj = vt + (j / g) * d;
                float *oj = os + j * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) oj[i] += w * vj[i];
            }
        }
    }
}
