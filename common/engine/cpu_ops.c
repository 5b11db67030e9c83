/* The decoder layer's small bf16 ops on the CPU, one pass each where torch runs several ops with a tensor between
 * every two: RMSNorm with the residual add fused in, RoPE on q and k with the K/V write into the paged cache, and
 * SiLU(gate) * up. Built and loaded with cpu_attention.c's machinery (cpu_build.py); called by cpu_ops.py.
 *
 * Each rounds to bf16 where the torch path does (kernels/reference.py, which follows Hugging Face), so the values
 * are torch's up to the order of a float32 sum (the norm's mean of squares) and the last bits of exp (SiLU's, by a
 * polynomial). Loops keep 8 independent lanes so the compiler vectorises them without -ffast-math, as in
 * cpu_attention.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define LANES 8
#define MAX_HEAD_DIM 512

static inline float mean_square(const float *x, int64_t n) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += x[i + l] * x[i + l];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float sum = lanes[0];
    for (; i < n; i++) sum += x[i] * x[i];
    return sum / (float)n;
}

/* x[0..n) := bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), in place, as float32 values of bf16s */
static inline void norm_in_place(float *x, const uint16_t *w, int64_t n, float eps) {
    float r = 1.0f / sqrtf(mean_square(x, n) + eps);
    for (int64_t i = 0; i < n; i++) x[i] = round_bf16(bf16_to_f32(w[i]) * round_bf16(x[i] * r));
}

#ifdef CPU_BF16_SIMD
/* One row of add_rms_norm_bf16, 16 lanes at a time; the squares summed in mean_square's order (8 lanes, a tree,
 * then the last n % 8 one by one), so the values are the scalar loop's to the bit */
static inline void add_rms_norm_row(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out,
                                    uint16_t *sum, float *row, int64_t n, float eps) {
    __m256 squares = _mm256_setzero_ps();
    int64_t whole = n / LANES * LANES;
    for (int64_t i = 0; i < n; i += 16) {
        int64_t m = n - i < 16 ? n - i : 16;
        __m512 s = load_bf16x16(x + i, m);
        if (residual) s = round_bf16_x16(_mm512_add_ps(s, load_bf16x16(residual + i, m)));
        if (sum) store_bf16x16(sum + i, s, m);
        _mm512_storeu_ps(row + i, s);  /* row has room for a whole last vector */
        __m256 lo = _mm512_castps512_ps256(s), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
        if (i + 8 <= whole) squares = _mm256_fmadd_ps(lo, lo, squares);
        if (i + 16 <= whole) squares = _mm256_fmadd_ps(hi, hi, squares);
    }
    float lanes[LANES];
    _mm256_storeu_ps(lanes, squares);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float total = lanes[0];
    for (int64_t i = whole; i < n; i++) total += row[i] * row[i];
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(total / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
        int64_t m = n - i < 16 ? n - i : 16;
        __m512 y = round_bf16_x16(_mm512_mul_ps(_mm512_loadu_ps(row + i), r));
        store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(w + i, m), y), m);
    }
}
#endif

/* Per row of n: s = bf16(x + residual) (x alone when residual is NULL), written to sum unless it is NULL;
 * out = RMSNorm(s) * w. Rows are contiguous. Returns 0, or -1 if the row buffer could not be allocated. */
int add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out, uint16_t *sum,
                      int64_t rows, int64_t n, float eps) {
    float *row = malloc(sizeof(float) * (size_t)(n + 16));
    if (!row) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
#ifdef CPU_BF16_SIMD
        add_rms_norm_row(xr, residual ? residual + r * n : NULL, w, out + r * n, sum ? sum + r * n : NULL, row, n,
                         eps);
        continue;
#endif
        if (residual) {
            const uint16_t *rr = residual + r * n;
            for (int64_t i = 0; i < n; i++) row[i] = round_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
        } else {
            for (int64_t i = 0; i < n; i++) row[i] = bf16_to_f32(xr[i]);
        }
        if (sum)
            for (int64_t i = 0; i < n; i++) sum[r * n + i] = f32_to_bf16(row[i]);
        norm_in_place(row, w, n, eps);
        for (int64_t i = 0; i < n; i++) out[r * n + i] = f32_to_bf16(row[i]);
    }
    free(row);
    return 0;
}

#ifdef CPU_BF16_SIMD
static inline __m512 negated(__m512 x) {  /* -x, the sign bit flipped (0 - x would give +0 for +0) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}
#endif

/* One head of D: (its RMSNorm, when norm is not NULL, then) RoPE in Hugging Face's rotate_half convention, pairs
 * (i, i + D/2): dst[i] = x[i] cos - x[i + D/2] sin, dst[i + D/2] = x[i + D/2] cos + x[i] sin, each product and the
 * sum rounded to bf16. cs: the position's cos of the D/2 frequencies ‖ their sin. */
static inline void rope_head(const uint16_t *src, const uint16_t *cs, const uint16_t *norm, float eps,
                             uint16_t *dst, int64_t D) {
    float x[MAX_HEAD_DIM];
    int64_t half = D / 2;
    for (int64_t i = 0; i < D; i++) x[i] = bf16_to_f32(src[i]);
    if (norm) norm_in_place(x, norm, D, eps);
#ifdef CPU_BF16_SIMD
    for (int64_t i = 0; i < half; i += 16) {
        int64_t m = half - i < 16 ? half - i : 16;
        __mmask16 k = (__mmask16)((1u << m) - 1);
        __m512 a = _mm512_maskz_loadu_ps(k, x + i), b = _mm512_maskz_loadu_ps(k, x + half + i);
        __m512 c = load_bf16x16(cs + i, m), sn = load_bf16x16(cs + half + i, m);
        store_bf16x16(dst + i, _mm512_add_ps(round_bf16_x16(_mm512_mul_ps(a, c)),
                                             round_bf16_x16(_mm512_mul_ps(negated(b), sn))), m);
        store_bf16x16(dst + half + i, _mm512_add_ps(round_bf16_x16(_mm512_mul_ps(b, c)),
                                                    round_bf16_x16(_mm512_mul_ps(a, sn))), m);
    }
    return;
#endif
    for (int64_t i = 0; i < half; i++) {
        float c = bf16_to_f32(cs[i]), s = bf16_to_f32(cs[half + i]);
        dst[i] = f32_to_bf16(round_bf16(x[i] * c) + round_bf16(-x[half + i] * s));
        dst[half + i] = f32_to_bf16(round_bf16(x[half + i] * c) + round_bf16(x[i] * s));
    }
}

/* Token t's row of qkv (q ‖ k ‖ v heads, row_stride elements apart): q's Hq heads roped into q_out [T, Hq, D];
 * k's Hkv heads roped and v's copied into the caches at slot slots[t] (not written when < 0), a slot Hkv * D
 * elements. Each head first through its RMSNorm where q_norm / k_norm (weights [D], with q_eps / k_eps) are not
 * NULL (Qwen3).
 * cos_sin [positions, D]: row p is position p's cos ‖ sin halves. D is even and at most MAX_HEAD_DIM. */
void rope_store_kv_bf16(const uint16_t *qkv, int64_t row_stride, const int64_t *positions, const uint16_t *cos_sin,
                        uint16_t *q_out, uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t T,
                        int64_t Hq, int64_t Hkv, int64_t D, const uint16_t *q_norm, const uint16_t *k_norm,
                        float q_eps, float k_eps) {
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *row = qkv + t * row_stride, *cs = cos_sin + positions[t] * D;
        for (int64_t h = 0; h < Hq; h++) rope_head(row + h * D, cs, q_norm, q_eps, q_out + (t * Hq + h) * D, D);
        if (slots[t] < 0) continue;
        int64_t at = slots[t] * Hkv * D;
        for (int64_t h = 0; h < Hkv; h++) rope_head(row + (Hq + h) * D, cs, k_norm, k_eps, k_cache + at + h * D, D);
        memcpy(v_cache + at, row + (Hq + Hkv) * D, sizeof(uint16_t) * (size_t)(Hkv * D));
    }
}

/* exp(x), clamped to [2^-126, 2^127], vectorisable (cpu_bf16.h's exp2_clamped) */
static inline float exp_clamped(float x) {
    float t = x * 1.44269504088896341f;
    return exp2_clamped(t < -126.0f ? -126.0f : t > 127.0f ? 127.0f : t);
}

/* Per row of x (gate ‖ up, 2 * inter): out = bf16(bf16(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) */
void silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * inter, *up = gate + inter;
        uint16_t *o = out + r * inter;
#ifdef CPU_BF16_SIMD
        for (int64_t i = 0; i < inter; i += 16) {
            int64_t m = inter - i < 16 ? inter - i : 16;
            __m512 g = load_bf16x16(gate + i, m);
            __m512 e = exp2_clamped_x16(_mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f)));
            __m512 silu = round_bf16_x16(_mm512_div_ps(g, _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
            store_bf16x16(o + i, _mm512_mul_ps(silu, load_bf16x16(up + i, m)), m);
        }
        continue;
#endif
        for (int64_t i = 0; i < inter; i++) {
            float g = bf16_to_f32(gate[i]);
            o[i] = f32_to_bf16(round_bf16(g / (1.0f + exp_clamped(-g))) * bf16_to_f32(up[i]));
        }
    }
}
