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

/* exp(x) for x <= 0 (scores less their maximum): 2^(x log2 e), the fraction by a degree-6 polynomial (relative
 * error below 1e-7, about expf's), so the loop vectorises where expf would be called once an element. */
static inline float exp_nonpositive(float x) {
    float t = (x < -126.0f ? -126.0f : x) * 1.44269504088896341f;
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
