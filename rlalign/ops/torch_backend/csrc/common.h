/* Shared by the CPU kernels: exact bfloat16 <-> fp32 conversions, as torch does them. */
#ifndef RLALIGN_CPU_KERNELS_COMMON_H
#define RLALIGN_CPU_KERNELS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* bf16 -> fp32: exact (the bf16 bits are the fp32's upper half) */
static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even (NaN -> a quiet NaN), as torch's .to(torch.bfloat16) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* below this many elements a call runs on one thread (torch's grain size) */
#define PARALLEL_MIN 32768

#endif
