/* GPTQ's per-input loop over one block of inputs (model/quant/gptq.py), row by row: given the upper Cholesky
 * factor of H^-1 on the block (hinv), each row rounds its inputs in order (to nearest even, as torch.round) and
 * moves each one's error onto the inputs after it. */
#include "common.h"

void gptq_block(float *w, const float *scale, const float *hinv, float *q, float *err, int64_t rows, int64_t width,
                float lowest, float largest) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *wr = w + r * width;
        const float *sr = scale + r * width;
        for (int64_t i = 0; i < width; i++) {
            const float s = sr[i];
            float rounded = nearbyintf(wr[i] / s);
            rounded = rounded < lowest ? lowest : (rounded > largest ? largest : rounded);
            const float e = (wr[i] - rounded * s) / hinv[i * width + i];
            q[r * width + i] = rounded;
            err[r * width + i] = e;
            const float *h = hinv + i * width;
            for (int64_t j = i + 1; j < width; j++)
                wr[j] -= e * h[j];
        }
    }
}
