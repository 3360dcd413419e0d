/* The strict linear's GEMM for a few rows, on the CPU: what the torch formulation computes with a
 * 64-row MKL tile (rows zero-padded to the block), without multiplying out the padding rows.
 *
 * Bits. Each output element is, per K segment, an fp32 FMA chain over the segment's k in increasing
 * order starting from 0 -- what MKL's fixed-shape tile computes for the shapes measured (the caller
 * checks it for each (K, N, segments) before first use) -- and the segments' partials are merged by
 * the canonical balanced tree ((s0 + s1) + (s2 + s3)) + ..., as primitives.tree_merge does.
 * -ffp-contract=off: no fused operation but the explicit fmaf.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NV 16         /* output columns per inner block */
#define MAX_PARTS 64

/* out[r][c] for rows r < m: x [m][k] fp32, wt [k][n] fp32 (the weight transposed), k = parts * seg */
void rl_small_gemm(const float *x, int64_t m, int64_t k, const float *wt, int64_t n, int64_t parts, float *out,
                   int64_t threads) {
    const int64_t seg = k / parts;
    const int64_t blocks = (n + NV - 1) / NV;
    #pragma omp parallel for schedule(static) num_threads(threads) if (m * k * n >= (1 << 18))
    for (int64_t job = 0; job < m * blocks; job++) {
        const int64_t r = job / blocks, c0 = (job % blocks) * NV;
        const int64_t width = n - c0 < NV ? n - c0 : NV;
        const float *xr = x + r * k;
        float part[MAX_PARTS][NV];
        for (int64_t s = 0; s < parts; s++) {
            float acc[NV];
            for (int i = 0; i < NV; i++) acc[i] = 0.0f;
            for (int64_t kk = s * seg; kk < (s + 1) * seg; kk++) {
                const float xv = xr[kk];
                const float *wr = wt + kk * n + c0;
                if (width == NV) {
                    for (int i = 0; i < NV; i++) acc[i] = fmaf(xv, wr[i], acc[i]);
                } else {
                    for (int64_t i = 0; i < width; i++) acc[i] = fmaf(xv, wr[i], acc[i]);
                }
            }
            memcpy(part[s], acc, sizeof acc);
        }
        for (int64_t live = parts; live > 1; live /= 2)       /* the canonical tree, level by level */
            for (int64_t s = 0; s < live / 2; s++)
                for (int i = 0; i < NV; i++) part[s][i] = part[2 * s][i] + part[2 * s + 1][i];
        memcpy(out + r * n + c0, part[0], (size_t)width * sizeof(float));
    }
}
