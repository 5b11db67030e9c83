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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* The same conversions 16 lanes at a time. gcc vectorises the scalar ones above, but round_bf16 and a clamp with a
 * ternary cost it masks, blends and, in SiLU, a second division per vector: the small ops ran at ~1 ns an element
 * (SmolLM2-135M's 128-token prefill: RMSNorm 75 us a call, SiLU * up 172 us). Same arithmetic, same results. */
#include <immintrin.h>
#define CPU_BF16_SIMD 1

/* n < 16 lanes of p as float32 (the rest zero) */
static inline __m512 load_bf16x16(const uint16_t *p, int64_t n) {
    __m256i h = n >= 16 ? _mm256_loadu_si256((const __m256i *)p)
                        : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* f32_to_bf16 of each lane, in the low half of its 32 bits */
static inline __m512i bf16_bits_x16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __m512 round_bf16_x16(__m512 f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits_x16(f), 16));
}

/* the first n <= 16 lanes of f to bf16 at p */
static inline void store_bf16x16(uint16_t *p, __m512 f, int64_t n) {
    __m512i bits = bf16_bits_x16(f);
    if (n >= 16) _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bits));
    else _mm512_mask_cvtepi32_storeu_epi16(p, (__mmask16)((1u << n) - 1), bits);
}

/* exp2_clamped of each lane, clamping t to [-126, 127] itself */
static inline __m512 exp2_clamped_x16(__m512 t) {
    t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(127.0f));
    __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, whole);
    __m512 p = _mm512_set1_ps(0.000218712622881867f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.001238241558894515f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009686185978353024f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.055478911846876144f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24023109674453735f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693146824836731f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvttps_epi32(whole), 23));
    return _mm512_castsi512_ps(bits);
}
#endif
#endif
