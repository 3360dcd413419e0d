/* The strict linear's GEMM on the CPU, for the shapes where it beats the library path: a few rows (what
 * the torch formulation computes with a zero-padded 64-row MKL tile, without multiplying out the
 * padding) and the canonical K partition (8 segment GEMMs of K/8 plus a tree merge, which MKL runs at a
 * fraction of its speed).
 *
 * Bits. Each output element is, per K segment, an fp32 chain of MAC steps (common.h) over the segment's
 * k in increasing order starting from 0 (under MKL's COMPATIBLE branch cut into CHAIN_BLOCKs, merged in
 * that branch's order) -- what MKL's fixed-shape tile computes for the shapes measured (the caller
 * checks it for each (K, N, segments) before first use) -- and the segments' partials are merged by
 * the canonical balanced tree ((s0 + s1) + (s2 + s3)) + ..., as primitives.tree_merge does. Rows are
 * computed in blocks of RB for speed; a row's operations do not depend on its block or neighbours, nor
 * a column's on its block, its offset or N.
 * -ffp-contract=off: no fused operation but the explicit fmaf.
 */
#include "common.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define NV 16         /* output columns per block (two 8-wide vectors) */
#if defined(__AVX512VL__)
#define RB 8          /* rows per block: 16 accumulators, in the 32 vector registers of AVX-512 */
#else
#define RB 4          /* rows per block: 8 accumulators, in the 16 vector registers of AVX2 */
#endif
#define MAX_PARTS 64

#if defined(__AVX2__) && defined(__FMA__)
#ifdef RL_MKL_COMPATIBLE
#define VMAC(a, b, c) _mm256_add_ps((c), _mm256_mul_ps((a), (b)))
#else
#define VMAC(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#endif
#endif

/* the chains over k0 .. k1 - 1 for RB rows x NV columns into acc: kept in 2 RB vector registers (with AVX2 + FMA;
 * VMAC rounds each lane exactly as MAC does). The block's size changes the speed only: every lane is one
 * output element's chain, in k order. */
static inline __attribute__((always_inline)) void chains(const float *const xr[RB], int64_t k0, int64_t k1,
                                                         const float *wt, int64_t n, float acc[RB][NV]) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a[RB][2];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t kk = k0; kk < k1; kk++) {
        const float *wr = wt + kk * n;
        const __m256 w0 = _mm256_loadu_ps(wr), w1 = _mm256_loadu_ps(wr + 8);
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
            const __m256 v = _mm256_broadcast_ss(xr[r] + kk);
            a[r][0] = VMAC(v, w0, a[r][0]);
            a[r][1] = VMAC(v, w1, a[r][1]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++) _mm256_storeu_ps(acc[r], a[r][0]), _mm256_storeu_ps(acc[r] + 8, a[r][1]);
#else
    for (int r = 0; r < RB; r++)
        for (int i = 0; i < NV; i++) acc[r][i] = 0.0f;
    for (int64_t kk = k0; kk < k1; kk++)
        for (int r = 0; r < RB; r++)
            for (int i = 0; i < NV; i++) acc[r][i] = MAC(xr[r][kk], wt[kk * n + i], acc[r][i]);
#endif
}

/* one K segment's chains: cut into CHAIN_BLOCKs where the build says so, the blocks merged in its order */
static inline __attribute__((always_inline)) void seg_chains(const float *const xr[RB], int64_t k0, int64_t k1,
                                                             const float *wt, int64_t n, float acc[RB][NV]) {
    const int64_t blocks = CHAIN_BLOCK ? (k1 - k0 + CHAIN_BLOCK - 1) / CHAIN_BLOCK : 1;
    if (blocks <= 1) {
        chains(xr, k0, k1, wt, n, acc);
        return;
    }
    float blk[RB][NV];
    chains(xr, k0 + (blocks - 1) * CHAIN_BLOCK, k1, wt, n, acc);   /* the last block */
    for (int64_t b = 0; b + 1 < blocks; b++) {
        chains(xr, k0 + b * CHAIN_BLOCK, k0 + (b + 1) * CHAIN_BLOCK, wt, n, blk);
        for (int r = 0; r < RB; r++)
            for (int i = 0; i < NV; i++) acc[r][i] = acc[r][i] + blk[r][i];   /* (P_last + P0) + P1 + ... */
    }
}

/* rows r0 .. r0 + rows - 1 (rows <= RB; missing rows read row r0, their results are dropped), columns
 * c0 .. c0 + NV - 1 (all inside n) */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k, const float *wt, int64_t n,
                                                       int64_t parts, int64_t r0, int64_t rows, int64_t c0,
                                                       float *out) {
    const int64_t seg = k / parts;
    const float *xr[RB];
    for (int r = 0; r < RB; r++) xr[r] = x + (r0 + (r < rows ? r : 0)) * k;
    float part[MAX_PARTS][RB][NV];
    for (int64_t s = 0; s < parts; s++)
        seg_chains(xr, s * seg, (s + 1) * seg, wt + c0, n, part[s]);
    for (int64_t live = parts; live > 1; live /= 2)       /* the canonical tree, level by level */
        for (int64_t s = 0; s < live / 2; s++)
            for (int r = 0; r < RB; r++)
                for (int i = 0; i < NV; i++) part[s][r][i] = part[2 * s][r][i] + part[2 * s + 1][r][i];
    for (int64_t r = 0; r < rows; r++) memcpy(out + (r0 + r) * n + c0, part[0][r], NV * sizeof(float));
}

/* one row's chains over k0 .. k1 - 1 for the columns c0 .. c0 + width - 1 into acc */
static void tail_chain(const float *xr, int64_t k0, int64_t k1, const float *wt, int64_t n, int64_t c0, int64_t width,
                       float *acc) {
    for (int64_t i = 0; i < width; i++) acc[i] = 0.0f;
    for (int64_t kk = k0; kk < k1; kk++)
        for (int64_t i = 0; i < width; i++) acc[i] = MAC(xr[kk], wt[kk * n + c0 + i], acc[i]);
}

/* the last n % NV columns, row by row */
static void tail_columns(const float *x, int64_t k, const float *wt, int64_t n, int64_t parts, int64_t r,
                         int64_t c0, float *out) {
    const int64_t seg = k / parts, width = n - c0;
    float part[MAX_PARTS][NV];
    for (int64_t s = 0; s < parts; s++) {
        const int64_t k0 = s * seg, k1 = (s + 1) * seg;
        const int64_t blocks = CHAIN_BLOCK ? (k1 - k0 + CHAIN_BLOCK - 1) / CHAIN_BLOCK : 1;
        float acc[NV] = {0};
        if (blocks <= 1) {
            tail_chain(x + r * k, k0, k1, wt, n, c0, width, acc);
        } else {   /* the blocks in seg_chains' order: (P_last + P0) + P1 + ... */
            float blk[NV];
            tail_chain(x + r * k, k0 + (blocks - 1) * CHAIN_BLOCK, k1, wt, n, c0, width, acc);
            for (int64_t b = 0; b + 1 < blocks; b++) {
                tail_chain(x + r * k, k0 + b * CHAIN_BLOCK, k0 + (b + 1) * CHAIN_BLOCK, wt, n, c0, width, blk);
                for (int64_t i = 0; i < width; i++) acc[i] = acc[i] + blk[i];
            }
        }
        memcpy(part[s], acc, sizeof acc);
    }
    for (int64_t live = parts; live > 1; live /= 2)
        for (int64_t s = 0; s < live / 2; s++)
            for (int i = 0; i < NV; i++) part[s][i] = part[2 * s][i] + part[2 * s + 1][i];
    memcpy(out + r * n + c0, part[0], (size_t)width * sizeof(float));
}

/* out[r][c] for rows r < m: x [m][k] fp32, wt [k][n] fp32 (the weight transposed), k = parts * seg */
void rl_gemm(const float *x, int64_t m, int64_t k, const float *wt, int64_t n, int64_t parts, float *out,
             int64_t threads) {
    const int64_t row_blocks = (m + RB - 1) / RB, col_blocks = n / NV;
    #pragma omp parallel for schedule(static) num_threads(threads) if (m * k * n >= (1 << 18))
    for (int64_t rb = 0; rb < row_blocks; rb++) {
        const int64_t r0 = rb * RB, rows = m - r0 < RB ? m - r0 : RB;
        for (int64_t cb = 0; cb < col_blocks; cb++) tile(x, k, wt, n, parts, r0, rows, cb * NV, out);
        if (n % NV)
            for (int64_t r = r0; r < r0 + rows; r++) tail_columns(x, k, wt, n, parts, r, col_blocks * NV, out);
    }
}
