/* bfloat16 <-> float32 for the CPU's C kernels (cpu_attention.c, cpu_ops.c). */
#ifndef DISAGG_CPU_BF16_H
#define DISAGG_CPU_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(torch.bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? ((u >> 16) | 0x40) : r);
}

/* f rounded to bfloat16, back as float32: the rounding torch does between two bf16 ops */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif
