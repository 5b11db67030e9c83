/* bfloat16 <-> float32 and a vectorisable exp for the CPU's C kernels (cpu_attention.c, cpu_ops.c). */
#ifndef DISAGG_CPU_BF16_H
#define DISAGG_CPU_BF16_H
#include <math.h>
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

/* 2^t for t in [-126, 127] (the caller clamps): the fraction by a degree-6 polynomial (relative error below 1e-7,
 * about expf's), the whole part added to the exponent's bits, so a loop over it vectorises where expf would be
 * called once an element. exp(x) = exp2_clamped(x * log2(e)). */
static inline float exp2_clamped(float t) {
    float whole = floorf(t), f = t - whole;
    float p = 0.000218712622881867f;
    p = p * f + 0.001238241558894515f;
    p = p * f + 0.009686185978353024f;
    p = p * f + 0.055478911846876144f;
    p = p * f + 0.24023109674453735f;
    p = p * f + 0.693146824836731f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)whole * (1 << 23);
    memcpy(&p, &bits, sizeof p);
    return p;
}
#endif
