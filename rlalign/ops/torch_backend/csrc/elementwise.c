/* Strict elementwise helpers on the CPU: the finiteness check of the ops' inputs, RoPE and the SwiGLU
 * product, written out as the torch formulation's operations in the same order (-ffp-contract=off;
 * torch's exp is applied by the caller where the formulation uses it). */
#include "common.h"

/* 1 if any of the n values is NaN or +-inf (all exponent bits set), else 0 */
int rl_any_nonfinite(const void *x, int64_t n, int64_t bf16) {
    uint32_t hit = 0;
    if (bf16) {
        const uint16_t *p = (const uint16_t *)x;
        for (int64_t i = 0; i < n; i++) hit |= (uint32_t)((p[i] & 0x7F80u) == 0x7F80u);
    } else {
        const uint32_t *p = (const uint32_t *)x;
        for (int64_t i = 0; i < n; i++) hit |= (uint32_t)((p[i] & 0x7F800000u) == 0x7F800000u);
    }
    return hit != 0;
}

/* Rotate-half RoPE of x [T][H][D] with tables cos/sin [T][D/2] (fp32):
 *   out[.., i] = x1 * c - x2 * s,  out[.., i + D/2] = x2 * c + x1 * s   (fp32, one rounding) */
void rl_rope(const void *x, const float *cos_t, const float *sin_t, int64_t t, int64_t h, int64_t d, int64_t bf16,
             void *out) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < t; r++) {
        const float *c = cos_t + r * half, *s = sin_t + r * half;
        for (int64_t e = 0; e < h; e++) {
            const int64_t base = (r * h + e) * d;
            for (int64_t i = 0; i < half; i++) {
                float x1, x2;
                if (bf16) {
                    x1 = bf16_to_f32(((const uint16_t *)x)[base + i]);
                    x2 = bf16_to_f32(((const uint16_t *)x)[base + half + i]);
                } else {
                    x1 = ((const float *)x)[base + i];
                    x2 = ((const float *)x)[base + half + i];
                }
                const float a = x1 * c[i], b = x2 * s[i], u = x2 * c[i], v = x1 * s[i];
                const float lo = a - b, hi = u + v;
                if (bf16) {
                    ((uint16_t *)out)[base + i] = f32_to_bf16(lo);
                    ((uint16_t *)out)[base + half + i] = f32_to_bf16(hi);
                } else {
                    ((float *)out)[base + i] = lo;
                    ((float *)out)[base + half + i] = hi;
                }
            }
        }
    }
}

/* SwiGLU after the caller's e = exp(-gate) (torch's exp, as in the formulation):
 *   out = round((g / (1 + e)) * up)   (fp32) */
void rl_silu_mul(const void *gate, const float *e, const void *up, int64_t n, int64_t bf16, void *out,
                 int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        float g, u;
        if (bf16) {
            g = bf16_to_f32(((const uint16_t *)gate)[i]);
            u = bf16_to_f32(((const uint16_t *)up)[i]);
        } else {
            g = ((const float *)gate)[i];
            u = ((const float *)up)[i];
        }
        const float denom = 1.0f + e[i];
        const float silu = g / denom;
        const float y = silu * u;
        if (bf16) ((uint16_t *)out)[i] = f32_to_bf16(y);
        else ((float *)out)[i] = y;
    }
}

/* The canonical K partition's merge: out = the balanced binary tree ((p0 + p1) + (p2 + p3)) + ... over
 * the P partials (P a power of two) of each of n elements; partial i at parts + i * stride (fp32). The
 * same adds, in the same tree, as primitives.tree_merge. */
void rl_tree_merge(const float *parts, int64_t p, int64_t stride, int64_t n, float *out, int64_t threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (n * p >= PARALLEL_MIN)
    for (int64_t c = 0; c < n; c += 256) {
        const int64_t len = n - c < 256 ? n - c : 256;
        float level[64][256];     /* p <= 64 */
        for (int64_t i = 0; i < p / 2; i++) {
            const float *a = parts + (2 * i) * stride + c, *b = parts + (2 * i + 1) * stride + c;
            for (int64_t x = 0; x < len; x++) level[i][x] = a[x] + b[x];
        }
        for (int64_t width = p / 2; width > 1; width /= 2)
            for (int64_t i = 0; i < width / 2; i++)
                for (int64_t x = 0; x < len; x++) level[i][x] = level[2 * i][x] + level[2 * i + 1][x];
        for (int64_t x = 0; x < len; x++) out[c + x] = p == 1 ? parts[c + x] : level[0][x];
    }
}
