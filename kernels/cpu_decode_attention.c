/* Paged decode attention for CPUs on a float32 or bfloat16 cache, reading K/V in place.
 *
 * Built and loaded by kernels/native.py (cc -O3 -march=native -ffast-math; no
 * Python or torch headers, called through ctypes). The torch path gathers every
 * decode's K/V into a padded copy before SDPA; this reads each K and V row of the
 * window once, from the cache, through the block table.
 *
 * Per decode request, three passes over its window: scores of all query heads
 * (query head j reads KV head j / G, G = num_heads / num_kv_heads) and their max,
 * exp and sum, weighted sum of V; all float32 (bfloat16 K/V are widened as read).
 * Positions are the outer loop: a position's K (or V) rows of all heads are
 * contiguous in the cache and read once, in address order. Measured in the engine (SmolLM2 fp32, 64 requests, time inside
 * attention): heads as the outer loop, re-reading each block once per KV head,
 * 39 to 40 s; positions outer 14 to 15 s; the SDPA path 25 to 30 s.
 *
 * Layout (strides in elements of the cache's dtype):
 *   q, out        row r at r * q_row / out_row, query head j at j * head_dim
 *   k, v          cache[block][offset][kv_head][d]: b * s_blk + o * s_off + h * s_head + d
 *   tables        int32 [num_decodes, table_row]: block ids of decode i's context
 *   rows          int32 [num_decodes]: query / output row of decode i
 *   firsts, lens  int32 [num_decodes]: decode i attends to positions [firsts[i], lens[i])
 *
 * Only positions inside each window are read, so stale or never-written cache
 * cells (even NaN) cannot reach the result. Returns 0, or -1 if scratch memory
 * could not be allocated (nothing written then).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Element idx of a cache row as float32: a float32 or a bfloat16 cache (the top
 * half of a float32), chosen by a constant so each copy of `attend` vectorizes. */
static inline __attribute__((always_inline)) float load(const void *restrict base, int64_t idx,
                                                        const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)base)[idx] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)base)[idx];
}

/* One decode request, all its KV heads. Positions are the outer loop, so each
 * position's K (then V) row of all heads, contiguous in the cache, is read once in
 * address order; the next block is prefetched at each block boundary. Inlined with
 * head_dim a constant for common sizes, so the d-loops unroll and vectorize.
 * scores: [H_kv * G, widest]; acc: [H_kv * G, D] accumulators. */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, float *restrict o, const void *restrict k,
    const void *restrict v, int64_t s_blk, int64_t s_off, int64_t s_head,
    const int32_t *restrict table, int32_t first, int32_t width, int32_t block_size,
    int32_t H, int32_t G, const int32_t D, float scale, float *restrict scores,
    int64_t widest, float *restrict acc, float *restrict sums, const int bf16) {
    const int32_t HG = H * G;
    for (int32_t t = 0; t < width; ++t) {
        const int32_t p = first + t;
        const int32_t off = p % block_size;
        if (off == 0 || t == 0) {
            const int32_t nb = p / block_size + 1;
            if (first + width > nb * block_size) {
                const int64_t e = bf16 ? 2 : 4;
                __builtin_prefetch((const char *)k + (int64_t)table[nb] * s_blk * e);
                __builtin_prefetch((const char *)v + (int64_t)table[nb] * s_blk * e);
            }
        }
        const int64_t kp = (int64_t)table[p / block_size] * s_blk + (int64_t)off * s_off;
        for (int32_t h = 0; h < H; ++h) {
            const int64_t kr = kp + (int64_t)h * s_head;
            for (int32_t g = 0; g < G; ++g) {
                const float *restrict qg = q + ((int64_t)h * G + g) * D;
                float s = 0.0f;
                for (int32_t d = 0; d < D; ++d) s += qg[d] * load(k, kr + d, bf16);
                scores[((int64_t)h * G + g) * widest + t] = s * scale;
            }
        }
    }
    for (int32_t j = 0; j < HG; ++j) {
        float *restrict sg = scores + (int64_t)j * widest;
        float m = -FLT_MAX; /* -ffast-math: no infinities */
        for (int32_t t = 0; t < width; ++t) m = sg[t] > m ? sg[t] : m;
        float total = 0.0f;
        for (int32_t t = 0; t < width; ++t) {
            sg[t] = expf(sg[t] - m);
            total += sg[t];
        }
        sums[j] = total;
    }
    for (int64_t x = 0; x < (int64_t)HG * D; ++x) acc[x] = 0.0f;
    for (int32_t t = 0; t < width; ++t) {
        const int32_t p = first + t;
        const int64_t vp = (int64_t)table[p / block_size] * s_blk + (int64_t)(p % block_size) * s_off;
        for (int32_t h = 0; h < H; ++h) {
            const int64_t vr = vp + (int64_t)h * s_head;
            for (int32_t g = 0; g < G; ++g) {
                const int64_t j = (int64_t)h * G + g;
                const float w = scores[j * widest + t];
                float *restrict aj = acc + j * D;
                for (int32_t d = 0; d < D; ++d) aj[d] += w * load(v, vr + d, bf16);
            }
        }
    }
    for (int32_t j = 0; j < HG; ++j) {
        const float inv = 1.0f / sums[j];
        for (int32_t d = 0; d < D; ++d) o[(int64_t)j * D + d] = acc[(int64_t)j * D + d] * inv;
    }
}

static inline __attribute__((always_inline)) int decode(
    const float *q, int64_t q_row, float *out, int64_t out_row, const void *k, const void *v,
    int64_t s_blk, int64_t s_off, int64_t s_head, const int32_t *tables, int64_t table_row,
    const int32_t *rows, const int32_t *firsts, const int32_t *lens, int64_t num_decodes,
    int32_t block_size, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, float scale,
    const int bf16) {
    const int32_t G = num_heads / num_kv_heads;
    int64_t widest = 1;
    for (int64_t i = 0; i < num_decodes; ++i) {
        const int64_t w = lens[i] - firsts[i];
        if (w > widest) widest = w;
    }
    float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)widest);
    float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)head_dim);
    float *sums = malloc(sizeof(float) * (size_t)num_heads);
    if (!scores || !acc || !sums) {
        free(scores);
        free(acc);
        free(sums);
        return -1;
    }
    for (int64_t i = 0; i < num_decodes; ++i) {
        const float *qi = q + (int64_t)rows[i] * q_row;
        float *oi = out + (int64_t)rows[i] * out_row;
        const int32_t *table = tables + i * table_row;
        const int32_t first = firsts[i], width = lens[i] - firsts[i];
        if (head_dim == 64)
            attend(qi, oi, k, v, s_blk, s_off, s_head, table, first, width, block_size,
                   num_kv_heads, G, 64, scale, scores, widest, acc, sums, bf16);
        else if (head_dim == 128)
            attend(qi, oi, k, v, s_blk, s_off, s_head, table, first, width, block_size,
                   num_kv_heads, G, 128, scale, scores, widest, acc, sums, bf16);
        else
            attend(qi, oi, k, v, s_blk, s_off, s_head, table, first, width, block_size,
                   num_kv_heads, G, head_dim, scale, scores, widest, acc, sums, bf16);
    }
    free(scores);
    free(acc);
    free(sums);
    return 0;
}

#define ENTRY(NAME, BF16)                                                                    \
    int NAME(const float *q, int64_t q_row, float *out, int64_t out_row, const void *k,     \
             const void *v, int64_t s_blk, int64_t s_off, int64_t s_head,                   \
             const int32_t *tables, int64_t table_row, const int32_t *rows,                 \
             const int32_t *firsts, const int32_t *lens, int64_t num_decodes,               \
             int32_t block_size, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, \
             float scale) {                                                                 \
        return decode(q, q_row, out, out_row, k, v, s_blk, s_off, s_head, tables, table_row, \
                      rows, firsts, lens, num_decodes, block_size, num_heads, num_kv_heads,  \
                      head_dim, scale, BF16);                                                \
    }

ENTRY(spur_decode_attention_f32, 0)
ENTRY(spur_decode_attention_bf16, 1)
