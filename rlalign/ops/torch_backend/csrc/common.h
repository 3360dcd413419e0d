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

/* One step of a dot-product chain, acc + a * b, and the longest chain (in k) that is one chain.
 *
 * The default build: one fused multiply-add (one rounding) per step, chains of any length -- what MKL's native
 * branches compute for the strict ops' GEMM tiles. Built with -DRL_MKL_COMPATIBLE (the library the kernels load
 * when MKL runs its COMPATIBLE branch, the cross-machine mode): the product rounded, then the sum (two roundings;
 * -ffp-contract=off keeps them apart), and K cut into blocks of CHAIN_BLOCK, each a chain from 0, merged as
 * ((P0 + P_last) + P1) + P2 + ... + P_{last-1} -- what that branch computes (measured per output element on
 * crafted inputs: docs/cpu.md, "Across machines"). */
#ifdef RL_MKL_COMPATIBLE
#define MAC(a, b, c) ((c) + (a) * (b))
#define CHAIN_BLOCK 112
#else
#define MAC(a, b, c) fmaf((a), (b), (c))
#define CHAIN_BLOCK 0   /* no blocking */
#endif

/* below this many elements a call runs on one thread (torch's grain size) */
#define PARALLEL_MIN 32768

#endif
