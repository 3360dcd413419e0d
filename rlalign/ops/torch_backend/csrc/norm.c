/* Strict RMSNorm on the CPU, row by row: the arithmetic of rlalign.ops.torch_backend.norm.rms_norm,
 * written out (three calls instead of ~20 small tensor ops per layer):
 *
 *   ms  = tree_sum(x * x) / H        (balanced pairwise tree, an odd last element carried up)
 *   inv = 1 / sqrt(ms + eps)         (torch's sqrt, applied by the caller between the two phases: on
 *                                     torch 2.13's CPU build it is not the correctly rounded one;
 *                                     then a correctly rounded division, never rsqrt)
 *   y   = round((x * inv) * w)       (fp32, one rounding to the output dtype)
 *
 * Every step is one correctly rounded fp32 operation, in the order written (-ffp-contract=off), so
 * the bits equal the torch formulation's; the tests compare the two with torch.equal.
 */
#include "common.h"

#define MAX_H 16384   /* larger rows: the caller runs the torch formulation */

static inline float load(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Phase 1, per row: ms_eps[r] = tree_sum(x * x) / H + eps. x rows [rows][h] (bf16 != 0: bfloat16, else
 * float32). Rows are independent: OpenMP threads (torch's pool) take contiguous ranges. */
void rl_rms_norm_stats(const void *x, int64_t rows, int64_t h, float eps, int64_t bf16, float *ms_eps,
                       int64_t threads) {
    if (h > MAX_H) return;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        float t[MAX_H];
        for (int64_t c = 0; c < h; c++) {
            const float xc = load(x, (int)bf16, r * h + c);
            t[c] = xc * xc;
        }
        int64_t n = h;
        while (n > 1) {
            const int64_t even = n - n % 2;
            for (int64_t i = 0; i < even / 2; i++) t[i] = t[2 * i] + t[2 * i + 1];
            if (n % 2) t[even / 2] = t[n - 1];
            n = even / 2 + n % 2;
        }
        const float ms = t[0] / (float)h;
        ms_eps[r] = ms + eps;
    }
}

/* Phase 2, after the caller's root = sqrt(ms_eps) (torch's sqrt, as in the torch formulation):
 * y = round((x * (1 / root)) * w); x, w and out share one dtype. */
void rl_rms_norm_apply(const void *x, const void *w, const float *root, int64_t rows, int64_t h, int64_t bf16,
                       void *out, int64_t threads) {
    if (h > MAX_H) return;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * h >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float inv = 1.0f / root[r];
        for (int64_t c = 0; c < h; c++) {
            const float scaled = load(x, (int)bf16, r * h + c) * inv;
            const float y = scaled * load(w, (int)bf16, c);
            if (bf16) ((uint16_t *)out)[r * h + c] = f32_to_bf16(y);
            else ((float *)out)[r * h + c] = y;
        }
    }
}
