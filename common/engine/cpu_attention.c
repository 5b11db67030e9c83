/* Paged decode attention on the CPU: one query token per sequence, read straight from the block-structured cache
 * (no gathered copy of the context). Built by common/engine/cpu_attention.py with the system C compiler, for this
 * machine (-march=native), and called through ctypes on the tensors' memory.
 *
 * Per sequence, K and V are read once, token by token, every KV head of a token at once (a token's heads are
 * contiguous in a block: [block_size, num_kv_heads, head_dim]); scores, softmax and the weighted sum run in
 * float32. Loops over head_dim keep 8 independent lanes so the compiler vectorises them without -ffast-math
 * (which would change the process's float environment); 8 measured faster than 16 (fewer steps to sum a dot
 * product's lanes: 8 decodes of 150 tokens 141 against 196 us) and than 4. The caches hold the query's dtype, or
 * FP8 (an FP8 KV cache), each byte read through a table of the 256 values times the cache's scale. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define LANES 8

enum { F32 = 0, BF16 = 1, FP8 = 2 };  /* storage: float32, bfloat16, float8_e4m3fn (caches only) */

/* float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinity, S.1111.111 is NaN */
static float fp8_e4m3fn_to_f32(uint8_t x) {
    int exponent = (x >> 3) & 15, mantissa = x & 7;
    float v = exponent == 15 && mantissa == 7 ? NAN
              : exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf(1.0f + mantissa / 8.0f, exponent - 7);
    return x & 0x80 ? -v : v;
}

/* row[0..d) as float32, from `kind` storage; an FP8 row through `fp8` (each byte's value times the cache's scale) */
static inline void load_row(const void *src, int64_t index, int64_t d, int kind, const float *fp8, float *dst) {
    if (kind == BF16) {
        const uint16_t *s = (const uint16_t *)src + index;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (kind == FP8) {
        const uint8_t *s = (const uint8_t *)src + index;
        for (int64_t i = 0; i < d; i++) dst[i] = fp8[s[i]];
    } else {
        memcpy(dst, (const float *)src + index, (size_t)d * sizeof(float));
    }
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += a[i + l] * b[i + l];
    for (int width = LANES / 2; width > 0; width /= 2)  /* a tree, which stays in vector registers */
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float sum = lanes[0];
    for (; i < d; i++) sum += a[i] * b[i];
    return sum;
}

/* exp(x) for x <= 0 (scores less their maximum), vectorisable (cpu_bf16.h's exp2_clamped). The clamp is on the
 * power of two, exp2_clamped's domain: x below -87.3 (-126 / log2(e)) would take the exponent's bits past zero and
 * return a huge value of either sign, not ~0 (a long prompt's scores spread that far). */
static inline float exp_nonpositive(float x) {
    float t = x * 1.44269504088896341f;
    return exp2_clamped(t < -126.0f ? -126.0f : t);
}

#if defined(CPU_BF16_SIMD) && defined(__AVX512BF16__)
#define DECODE_BF16_SIMD 1
#define MAX_GROUP 16
#define MAX_D 256

/* the 16 sums of each vector's 16 lanes, as one vector (lane i: the sum of v[i]): a transposing tree of 15 adds
 * where one reduction a vector takes four */
static inline __m512 sum_each_x16(const __m512 *v) {
    __m512 quads[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *a = v + 4 * g;
        __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
        __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
        __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
        quads[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    }
    __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* s[0..n) = softmax(s), 16 lanes at a time: exp_nonpositive's arithmetic (exp2_clamped_x16), the division last */
static inline void softmax_x16(float *s, int64_t n) {
    __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = (__mmask16)(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
        top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + t));
    }
    __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top)), log2e = _mm512_set1_ps(1.44269504088896341f);
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = (__mmask16)(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
        __m512 e = exp2_clamped_x16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), max), log2e));
        _mm512_mask_storeu_ps(s + t, m, e);
        total = _mm512_mask_add_ps(total, m, total, e);
    }
    __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));
    for (int64_t t = 0; t < n; t += 16) {
        __mmask16 m = (__mmask16)(n - t >= 16 ? 0xffff : (1u << (n - t)) - 1);
        _mm512_mask_storeu_ps(s + t, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, s + t), sum));
    }
}

/* The decode of one sequence and KV head for bf16 q and caches, head_dim D a multiple of 32 (up to MAX_D), G query
 * heads a KV head (up to MAX_GROUP). Sixteen keys at a time are scored against each head with vdpbf16ps, two dims a
 * lane (as the prefill kernel's bf16 pairs), and their sixteen dot products summed by one transposing tree; softmax
 * runs 16 lanes at a time; a value row is converted once and folded into every head's float32 sums, which stay in
 * registers. The scalar kernel below converts every row to float32 and sums each dot alone: about 3x slower at
 * eight decodes (docs/benchmarks/vllm_cpu.md, "the decode attention kernel"). Only a dot's rounding differs. */
static inline __attribute__((always_inline)) void decode_group_bf16(
        const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out, const int64_t *blocks,
        int64_t start, int64_t len, int64_t block_size, int64_t row, int64_t block_stride, float scale,
        float *scores, const int64_t D, const int64_t G) {
    const int64_t nk = D / 32, nv = D / 16;
    __m512bh qv[MAX_GROUP][MAX_D / 32];
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < nk; j++) qv[h][j] = (__m512bh)_mm512_loadu_si512(q + h * D + 32 * j);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {  /* 16 keys at a time: their 16 dot products summed at once */
        int64_t n = len - t0 < 16 ? len - t0 : 16;
        const uint16_t *k[16];
        for (int64_t t = 0; t < n; t++) {
            int64_t pos = start + t0 + t;
            k[t] = k_cache + blocks[pos / block_size] * block_stride + (pos % block_size) * row;
        }
        for (int64_t h = 0; h < G; h++) {
            __m512 dots[16];
            for (int64_t t = 0; t < 16; t++) {
                __m512 acc = _mm512_setzero_ps();
                const uint16_t *kt = k[t < n ? t : 0];  /* past the last key: any key's, masked out below */
                for (int64_t j = 0; j < nk; j++)
                    acc = _mm512_dpbf16_ps(acc, qv[h][j], (__m512bh)_mm512_loadu_si512(kt + 32 * j));
                dots[t] = acc;
            }
            _mm512_mask_storeu_ps(scores + h * len + t0, (__mmask16)((1u << n) - 1),
                                  _mm512_mul_ps(sum_each_x16(dots), _mm512_set1_ps(scale)));
        }
    }
    for (int64_t h = 0; h < G; h++) softmax_x16(scores + h * len, len);
    __m512 acc[MAX_GROUP][MAX_D / 16];
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < nv; j++) acc[h][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t++) {
        int64_t pos = start + t;
        const uint16_t *v = v_cache + blocks[pos / block_size] * block_stride + (pos % block_size) * row;
        __m512 vf[MAX_D / 16];
        for (int64_t j = 0; j < nv; j++) vf[j] = load_bf16x16(v + 16 * j, 16);
        for (int64_t h = 0; h < G; h++) {
            __m512 p = _mm512_set1_ps(scores[h * len + t]);
            for (int64_t j = 0; j < nv; j++) acc[h][j] = _mm512_fmadd_ps(p, vf[j], acc[h][j]);
        }
    }
    for (int64_t h = 0; h < G; h++)
        for (int64_t j = 0; j < nv; j++) store_bf16x16(out + h * D + 16 * j, acc[h][j], 16);
}

/* paged_decode_attention's bf16 case on decode_group_bf16, with the common shapes' D and G as constants (their
 * loops unrolled, the sums in registers) */
static void decode_bf16_simd(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                             const int64_t *block_ids, const int64_t *seq_lens, const int64_t *starts, int64_t B,
                             int64_t max_blocks, int64_t block_size, int64_t Hq, int64_t Hkv, int64_t D,
                             int64_t block_stride, float scale, float *scores) {
    int64_t G = Hq / Hkv, row = Hkv * D;
    for (int64_t b = 0; b < B; b++) {
        int64_t start = starts[b], len = seq_lens[b] - start;
        const int64_t *blocks = block_ids + b * max_blocks;
        for (int64_t g = 0; g < Hkv; g++) {
            const uint16_t *qg = q + (b * Hq + g * G) * D, *kg = k_cache + g * D, *vg = v_cache + g * D;
            uint16_t *og = out + (b * Hq + g * G) * D;
#define GROUP_CASE(d, gq) decode_group_bf16(qg, kg, vg, og, blocks, start, len, block_size, row, block_stride, \
                                            scale, scores, d, gq)
            if (D == 64 && G == 3) GROUP_CASE(64, 3);
            else if (D == 64 && G == 4) GROUP_CASE(64, 4);
            else if (D == 128 && G == 4) GROUP_CASE(128, 4);
            else if (D == 128 && G == 8) GROUP_CASE(128, 8);
            else GROUP_CASE(D, G);
#undef GROUP_CASE
        }
    }
}
#endif

/* out[b, h, :] = softmax(q[b, h] . K[b]^T * scale) V[b] over the tokens [starts[b], seq_lens[b]) of sequence b,
 * whose token t lives at block block_ids[b * max_blocks + t / block_size], row t % block_size.
 * q, out: [B, Hq, D]; caches: blocks block_stride elements apart, a block [block_size, Hkv, D]; query head h
 * reads KV head h / (Hq / Hkv). q and out are bf16 (is_bf16) or float32; the caches are `cache_kind` storage, an FP8
 * cache's values times kv_scale. Returns 0, or -1 if a workspace could not be allocated. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_ids, const int64_t *seq_lens, const int64_t *starts,
                           int64_t B, int64_t max_blocks, int64_t block_size, int64_t Hq, int64_t Hkv, int64_t D,
                           int64_t block_stride, float scale, int is_bf16, int cache_kind, float kv_scale) {
    int64_t group = Hq / Hkv, row = Hkv * D, longest = 0;
    float fp8[256];
    if (cache_kind == FP8)
        for (int i = 0; i < 256; i++) fp8[i] = fp8_e4m3fn_to_f32((uint8_t)i) * kv_scale;
    for (int64_t b = 0; b < B; b++)
        if (seq_lens[b] - starts[b] > longest) longest = seq_lens[b] - starts[b];
    float *qf = malloc(sizeof(float) * (size_t)(Hq * D));
    float *acc = malloc(sizeof(float) * (size_t)(Hq * D));
    float *kv = malloc(sizeof(float) * (size_t)row);
    float *scores = malloc(sizeof(float) * (size_t)(Hq * (longest > 0 ? longest : 1)));
    if (!qf || !acc || !kv || !scores) {
        free(qf); free(acc); free(kv); free(scores);
        return -1;
    }
#ifdef DECODE_BF16_SIMD
    if (is_bf16 && cache_kind == BF16 && D % 32 == 0 && D <= MAX_D && Hq % Hkv == 0 && group <= MAX_GROUP) {
        decode_bf16_simd(q, k_cache, v_cache, out, block_ids, seq_lens, starts, B, max_blocks, block_size, Hq, Hkv, D,
                         block_stride, scale, scores);
        free(qf); free(acc); free(kv); free(scores);
        return 0;
    }
#endif
    for (int64_t b = 0; b < B; b++) {
        int64_t start = starts[b], len = seq_lens[b] - start;
        const int64_t *blocks = block_ids + b * max_blocks;
        load_row(q, b * Hq * D, Hq * D, is_bf16 ? BF16 : F32, fp8, qf);
        for (int64_t t = 0; t < len; t++) {
            int64_t pos = start + t;
            load_row(k_cache, blocks[pos / block_size] * block_stride + (pos % block_size) * row, row, cache_kind, fp8,
                     kv);
            for (int64_t h = 0; h < Hq; h++)
                scores[h * len + t] = dot(qf + h * D, kv + (h / group) * D, D) * scale;
        }
        for (int64_t h = 0; h < Hq; h++) {
            float *s = scores + h * len, top = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
            for (int64_t t = 0; t < len; t++) s[t] = exp_nonpositive(s[t] - top);
            for (int64_t t = 0; t < len; t++) total += s[t];
            for (int64_t t = 0; t < len; t++) s[t] /= total;
        }
        memset(acc, 0, sizeof(float) * (size_t)(Hq * D));
        for (int64_t t = 0; t < len; t++) {
            int64_t pos = start + t;
            load_row(v_cache, blocks[pos / block_size] * block_stride + (pos % block_size) * row, row, cache_kind, fp8,
                     kv);
            for (int64_t h = 0; h < Hq; h++) {
                float p = scores[h * len + t], *a = acc + h * D;
                const float *v = kv + (h / group) * D;
                for (int64_t i = 0; i < D; i++) a[i] += p * v[i];
            }
        }
        if (is_bf16) {
            uint16_t *o = (uint16_t *)out + b * Hq * D;
            for (int64_t i = 0; i < Hq * D; i++) o[i] = f32_to_bf16(acc[i]);
        } else {
            memcpy((float *)out + b * Hq * D, acc, sizeof(float) * (size_t)(Hq * D));
        }
    }
    free(qf); free(acc); free(kv); free(scores);
    return 0;
}

/* Paged prefill attention: the query tokens of each sequence's chunk attend causally to the sequence's cached
 * context and to the chunk itself (its K/V are in the cache already), optionally within a sliding window.
 *
 * Flash-attention order, so each K and V row is converted once per tile and then reused from the caches: per
 * sequence, KV head and tile of TILE_Q query tokens (every query head of the group: TILE_Q * group rows), the keys
 * the tile may see are read from the blocks KEYS at a time into float32 (K transposed, TILE_K keys a chunk), scored
 * against every row of the tile, and folded into each row's running maximum, sum and weighted sum (online softmax,
 * all float32) over only the keys that row sees. On one core of the development machine (SmolLM2-135M's 9 / 3 heads
 * of 64, a 128-token prompt, bf16) it took 445 us a layer against the torch path's 650 (gather, then SDPA in
 * float32); softmax's reductions as TILE_K lanes over a whole pass rather than a chunk at a time made it 465 ->
 * 445 us; TILE_K 32 or 8, eight rows scored at once and two sums in the weighted sum measured no faster or slower.
 * Later (another hour, 483 us then): each K/V row converted once per KV head, 373 us; bf16 scores on pairs, 321. */
#define TILE_Q 16
#define TILE_K 16
#define KEYS 128  /* keys scored per pass: softmax's reductions run over up to KEYS scores of a row at once */

/* s[r * ld + j] = q[r] . kt[:, j], j < TILE_K, for `rows` rows of q ([rows, d]) and a transposed chunk kt
 * ([d, TILE_K]); four rows at once (eight measured no faster) */
static inline void score_chunk(const float *q, const float *kt, float *s, int64_t rows, int64_t d, int64_t ld) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        float s0[TILE_K] = {0}, s1[TILE_K] = {0}, s2[TILE_K] = {0}, s3[TILE_K] = {0};
        const float *q0 = q + r * d, *q1 = q0 + d, *q2 = q1 + d, *q3 = q2 + d;
        for (int64_t i = 0; i < d; i++) {
            const float *k = kt + i * TILE_K;
            for (int j = 0; j < TILE_K; j++) {
                s0[j] += q0[i] * k[j];
                s1[j] += q1[i] * k[j];
                s2[j] += q2[i] * k[j];
                s3[j] += q3[i] * k[j];
            }
        }
        memcpy(s + r * ld, s0, sizeof s0);
        memcpy(s + (r + 1) * ld, s1, sizeof s1);
        memcpy(s + (r + 2) * ld, s2, sizeof s2);
        memcpy(s + (r + 3) * ld, s3, sizeof s3);
    }
    for (; r < rows; r++) {
        float s0[TILE_K] = {0};
        const float *q0 = q + r * d;
        for (int64_t i = 0; i < d; i++)
            for (int j = 0; j < TILE_K; j++) s0[j] += q0[i] * kt[i * TILE_K + j];
        memcpy(s + r * ld, s0, sizeof s0);
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>
#define BF16_PAIRS 1
/* score_chunk for bf16 q and keys, as pairs of bf16 in 32 bits: q [rows, d2] and a chunk kt [d2, TILE_K] (element
 * i: dims 2i and 2i + 1), scored with vdpbf16ps, two dims a lane and instruction where float32 FMAs take one (the
 * products are exact in float32, as when converted; the sums round at each pair, not each dim) */
static inline void score_chunk_pairs(const uint32_t *q, const uint32_t *kt, float *s, int64_t rows, int64_t d2,
                                     int64_t ld) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        const uint32_t *q0 = q + r * d2, *q1 = q0 + d2, *q2 = q1 + d2, *q3 = q2 + d2;
        for (int64_t i = 0; i < d2; i++) {
            __m512bh k = (__m512bh)_mm512_loadu_si512(kt + i * TILE_K);
            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32((int)q0[i]), k);
            s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_set1_epi32((int)q1[i]), k);
            s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_set1_epi32((int)q2[i]), k);
            s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_set1_epi32((int)q3[i]), k);
        }
        _mm512_storeu_ps(s + r * ld, s0);
        _mm512_storeu_ps(s + (r + 1) * ld, s1);
        _mm512_storeu_ps(s + (r + 2) * ld, s2);
        _mm512_storeu_ps(s + (r + 3) * ld, s3);
    }
    for (; r < rows; r++) {
        __m512 s0 = _mm512_setzero_ps();
        for (int64_t i = 0; i < d2; i++)
            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32((int)q[r * d2 + i]),
                                  (__m512bh)_mm512_loadu_si512(kt + i * TILE_K));
        _mm512_storeu_ps(s + r * ld, s0);
    }
}
#endif

/* x[0..n) *= scale; returns their maximum (TILE_K lanes, then a tree: the loop vectorises) */
static inline float scale_and_max(float *x, int64_t n, float scale) {
    float lanes[TILE_K];
    for (int l = 0; l < TILE_K; l++) lanes[l] = -INFINITY;
    int64_t j = 0;
    for (; j + TILE_K <= n; j += TILE_K)
        for (int l = 0; l < TILE_K; l++) {
            x[j + l] *= scale;
            lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
        }
    for (; j < n; j++) {
        x[j] *= scale;
        lanes[0] = x[j] > lanes[0] ? x[j] : lanes[0];
    }
    for (int width = TILE_K / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] = lanes[l + width] > lanes[l] ? lanes[l + width] : lanes[l];
    return lanes[0];
}

/* x[0..n) = exp(x - top); returns their sum (TILE_K lanes, then a tree) */
static inline float exp_and_sum(float *x, int64_t n, float top) {
    float lanes[TILE_K] = {0};
    int64_t j = 0;
    for (; j + TILE_K <= n; j += TILE_K)
        for (int l = 0; l < TILE_K; l++) {
            x[j + l] = exp_nonpositive(x[j + l] - top);
            lanes[l] += x[j + l];
        }
    for (; j < n; j++) {
        x[j] = exp_nonpositive(x[j] - top);
        lanes[0] += x[j];
    }
    for (int width = TILE_K / 2; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* acc[0..d) = acc * correction + sum_j p[j] v[j], j < TILE_K; with d a constant where inlined (the common head
 * sizes), the loop over d vectorises with acc in registers across the chunk */
static inline __attribute__((always_inline)) void fold_values(float *acc, const float *p, const float *v,
                                                              float correction, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        float a = acc[i] * correction;
        for (int j = 0; j < TILE_K; j++) a += p[j] * v[j * d + i];
        acc[i] = a;
    }
}

/* out[row] for the query tokens of S sequences packed in q / out ([T, Hq, D], bf16 if is_bf16 else float32):
 * sequence s has query_lens[s] tokens from row rows[s], at positions context_lens[s] onwards, and its token t lives
 * at block block_ids[s * max_blocks + t / block_size], row t % block_size of the caches (as for the decode kernel).
 * Query token at position p sees keys [p - window + 1, p] (window > 0), or [0, p]. Rows of q outside the
 * sequences are not written. Returns 0, or -1 if a workspace could not be allocated. */
int paged_prefill_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                            const int64_t *block_ids, const int64_t *rows, const int64_t *query_lens,
                            const int64_t *context_lens, int64_t S, int64_t max_blocks, int64_t block_size,
                            int64_t Hq, int64_t Hkv, int64_t D, int64_t block_stride, float scale, int64_t window,
                            int is_bf16, int cache_kind, float kv_scale) {
    int64_t group = Hq / Hkv, row = Hkv * D, tile_rows = TILE_Q * group;
    float fp8[256];
    if (cache_kind == FP8)
        for (int i = 0; i < 256; i++) fp8[i] = fp8_e4m3fn_to_f32((uint8_t)i) * kv_scale;
    float *qt = malloc(sizeof(float) * (size_t)(tile_rows * D));
    float *acc = malloc(sizeof(float) * (size_t)(tile_rows * D));
    float *krow = malloc(sizeof(float) * (size_t)D);
    float *krow_chunk = malloc(sizeof(float) * (size_t)(D * TILE_K));
    float *s = malloc(sizeof(float) * (size_t)(tile_rows * KEYS));
    float *top = malloc(sizeof(float) * (size_t)tile_rows);
    float *total = malloc(sizeof(float) * (size_t)tile_rows);
    float *kt = NULL, *vv = NULL;
    int status = -1;
#ifdef BF16_PAIRS
    int pairs = is_bf16 && cache_kind == BF16 && D % 2 == 0;  /* q and K scored as bf16 pairs (score_chunk_pairs) */
#else
    int pairs = 0;
#endif
    int64_t width = pairs ? D / 2 : D;  /* a K or q row as the scores read it: D/2 pairs of bf16, or D floats */
    if (!qt || !acc || !krow || !krow_chunk || !s || !top || !total)
        goto done;
    for (int64_t seq = 0; seq < S; seq++) {
        const int64_t *blocks = block_ids + seq * max_blocks;
        int64_t ctx = context_lens[seq], n = query_lens[seq];
        /* keys [base, ctx + n) are all the chunk's queries see: as float32 once per KV head, not once per tile
         * that sees them (128-token prompt: 480 -> 405 us a layer), K transposed in chunks of TILE_K keys
         * ([D, TILE_K] each), V as rows, zeros past the last key (never visible) and a chunk beyond (a pass that
         * starts off the chunks reads up to TILE_K - 1 columns past its last key) */
        int64_t base = window > 0 && ctx - window + 1 > 0 ? ctx - window + 1 : 0;
        int64_t keys = ctx + n - base, padded = (keys + TILE_K - 1) / TILE_K * TILE_K + TILE_K;
        free(kt); free(vv);
        kt = malloc(sizeof(float) * (size_t)(padded * D));
        vv = malloc(sizeof(float) * (size_t)(padded * D));
        if (!kt || !vv)
            goto done;
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            for (int64_t j = 0; j < padded; j++) {
                uint32_t *chunk = (uint32_t *)kt + j / TILE_K * TILE_K * width;  /* floats or bf16 pairs */
                if (j < keys) {
                    int64_t pos = base + j, at = blocks[pos / block_size] * block_stride + (pos % block_size) * row
                                                 + kvh * D;
                    if (pairs)
                        memcpy(krow, (const uint16_t *)k_cache + at, sizeof(uint16_t) * (size_t)D);
                    else
                        load_row(k_cache, at, D, cache_kind, fp8, krow);
                    load_row(v_cache, at, D, cache_kind, fp8, vv + j * D);
                } else {
                    memset(krow, 0, sizeof(float) * (size_t)D);
                    memset(vv + j * D, 0, sizeof(float) * (size_t)D);
                }
                const uint32_t *bits = (const uint32_t *)krow;
                for (int64_t i = 0; i < width; i++) chunk[i * TILE_K + j % TILE_K] = bits[i];
            }
            for (int64_t t0 = 0; t0 < n; t0 += TILE_Q) {
                int64_t tq = n - t0 < TILE_Q ? n - t0 : TILE_Q, nr = tq * group;
                int64_t first = ctx + t0, last = first + tq - 1;  /* the tile's positions */
                int64_t lo = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
                for (int64_t t = 0; t < tq; t++) {  /* row t * group + g: token t0 + t, query head kvh * group + g */
                    int64_t at = ((rows[seq] + t0 + t) * Hq + kvh * group) * D;
                    if (pairs)
                        memcpy((uint32_t *)qt + t * group * width, (const uint16_t *)q + at,
                               sizeof(uint16_t) * (size_t)(group * D));
                    else
                        load_row(q, at, group * D, is_bf16 ? BF16 : F32, fp8, qt + t * group * D);
                }
                for (int64_t r = 0; r < nr; r++) top[r] = -INFINITY, total[r] = 0.0f;
                memset(acc, 0, sizeof(float) * (size_t)(nr * D));
                for (int64_t k0 = lo; k0 <= last; k0 += KEYS) {
                    int64_t nk = last + 1 - k0 < KEYS ? last + 1 - k0 : KEYS;
                    const float *vp = vv + (k0 - base) * D;  /* this pass's values */
                    for (int64_t c = 0; c < nk; c += TILE_K) {  /* scores of every row */
                        int64_t col = k0 - base + c, off = col % TILE_K;
                        const uint32_t *chunk = (const uint32_t *)kt + (col - off) * width;
                        if (off) {  /* a window's pass that starts off the chunks (base clamped to 0): from two */
                            const uint32_t *next = chunk + width * TILE_K;
                            uint32_t *joined = (uint32_t *)krow_chunk;
                            for (int64_t i = 0; i < width; i++)
                                for (int j = 0; j < TILE_K; j++)
                                    joined[i * TILE_K + j] = j + off < TILE_K ? chunk[i * TILE_K + j + off]
                                                                              : next[i * TILE_K + j + off - TILE_K];
                            chunk = joined;
                        }
#ifdef BF16_PAIRS
                        if (pairs) {
                            score_chunk_pairs((const uint32_t *)qt, chunk, s + c, nr, width, KEYS);
                            continue;
                        }
#endif
                        score_chunk(qt, (const float *)chunk, s + c, nr, D, KEYS);
                    }
                    for (int64_t r = 0; r < nr; r++) {
                        /* the keys [from, p] this row sees, as columns [j0, j1] of this pass */
                        int64_t p = first + r / group, from = window > 0 ? p - window + 1 : 0;
                        int64_t j0 = from > k0 ? from - k0 : 0, j1 = p - k0 < nk - 1 ? p - k0 : nk - 1;
                        if (j0 > j1)
                            continue;
                        float *sr = s + r * KEYS, *a = acc + r * D;
                        float m = scale_and_max(sr + j0, j1 + 1 - j0, scale);
                        m = m > top[r] ? m : top[r];
                        float sum = exp_and_sum(sr + j0, j1 + 1 - j0, m);
                        float correction = exp_nonpositive(top[r] - m);  /* top -inf: ~0, times zeros */
                        top[r] = m;
                        total[r] = total[r] * correction + sum;
                        /* the weighted sum TILE_K columns at a time, the columns around [j0, j1] zero */
                        int64_t g0 = j0 / TILE_K * TILE_K, g1 = j1 / TILE_K * TILE_K + TILE_K;
                        for (int64_t j = g0; j < j0; j++) sr[j] = 0.0f;
                        for (int64_t j = j1 + 1; j < g1; j++) sr[j] = 0.0f;
                        for (int64_t g = g0; g < g1; g += TILE_K) {
                            float c = g == g0 ? correction : 1.0f;
                            if (D == 64) fold_values(a, sr + g, vp + g * D, c, 64);
                            else if (D == 128) fold_values(a, sr + g, vp + g * D, c, 128);
                            else fold_values(a, sr + g, vp + g * D, c, D);
                        }
                    }
                }
                for (int64_t t = 0; t < tq; t++) {
                    int64_t at = ((rows[seq] + t0 + t) * Hq + kvh * group) * D;
                    for (int64_t g = 0; g < group; g++) {
                        int64_t r = t * group + g;
                        float inv = 1.0f / total[r], *a = acc + r * D;
                        if (is_bf16) {
                            uint16_t *o = (uint16_t *)out + at + g * D;
                            for (int64_t i = 0; i < D; i++) o[i] = f32_to_bf16(a[i] * inv);
                        } else {
                            float *o = (float *)out + at + g * D;
                            for (int64_t i = 0; i < D; i++) o[i] = a[i] * inv;
                        }
                    }
                }
            }
        }
    }
    status = 0;
done:
    free(qt); free(acc); free(krow); free(krow_chunk); free(s); free(top); free(total); free(kt); free(vv);
    return status;
}
