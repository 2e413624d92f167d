/* Paged decode attention for CPUs on a float32 cache, reading K/V in place.
 *
 * Built and loaded by kernels/native.py (cc -O3 -march=native -ffast-math; no
 * Python or torch headers, called through ctypes). The torch path gathers every
 * decode's K/V into a padded copy before SDPA; this reads each K and V row of the
 * window once, from the cache, through the block table.
 *
 * One work item = (decode request i, KV head h). Its G = num_heads / num_kv_heads
 * query heads share the item's K/V. Three passes over the window: scores and their
 * max, exp and sum, weighted sum of V; all float32.
 *
 * Layout (strides in floats):
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

int spur_decode_attention_f32(const float *q, int64_t q_row, float *out, int64_t out_row,
                              const float *k, const float *v, int64_t s_blk, int64_t s_off,
                              int64_t s_head, const int32_t *tables, int64_t table_row,
                              const int32_t *rows, const int32_t *firsts, const int32_t *lens,
                              int64_t num_decodes, int32_t block_size, int32_t num_heads,
                              int32_t num_kv_heads, int32_t head_dim, float scale) {
    const int32_t G = num_heads / num_kv_heads;
    int32_t widest = 1;
    for (int64_t i = 0; i < num_decodes; ++i) {
        const int32_t w = lens[i] - firsts[i];
        if (w > widest) widest = w;
    }
    float *scores = malloc(sizeof(float) * (size_t)G * (size_t)widest);
    float *acc = malloc(sizeof(float) * (size_t)G * (size_t)head_dim);
    float *mx = malloc(sizeof(float) * (size_t)G);
    float *sum = malloc(sizeof(float) * (size_t)G);
    if (!scores || !acc || !mx || !sum) {
        free(scores);
        free(acc);
        free(mx);
        free(sum);
        return -1;
    }
    for (int64_t i = 0; i < num_decodes; ++i) {
        const int32_t first = firsts[i], width = lens[i] - firsts[i];
        const int32_t *table = tables + i * table_row;
        for (int32_t h = 0; h < num_kv_heads; ++h) {
            const float *qh = q + (int64_t)rows[i] * q_row + (int64_t)h * G * head_dim;
            float *oh = out + (int64_t)rows[i] * out_row + (int64_t)h * G * head_dim;
            for (int32_t g = 0; g < G; ++g) mx[g] = -FLT_MAX; /* -ffast-math: no infinities */
            for (int32_t t = 0; t < width; ++t) {
                const int32_t p = first + t;
                const float *kr = k + (int64_t)table[p / block_size] * s_blk +
                                  (int64_t)(p % block_size) * s_off + (int64_t)h * s_head;
                for (int32_t g = 0; g < G; ++g) {
                    const float *qg = qh + (int64_t)g * head_dim;
                    float s = 0.0f;
                    for (int32_t d = 0; d < head_dim; ++d) s += qg[d] * kr[d];
                    s *= scale;
                    scores[(int64_t)g * widest + t] = s;
                    if (s > mx[g]) mx[g] = s;
                }
            }
            for (int32_t g = 0; g < G; ++g) {
                float *sg = scores + (int64_t)g * widest;
                const float m = mx[g];
                float total = 0.0f;
                for (int32_t t = 0; t < width; ++t) {
                    sg[t] = expf(sg[t] - m);
                    total += sg[t];
                }
                sum[g] = total;
            }
            memset(acc, 0, sizeof(float) * (size_t)G * (size_t)head_dim);
            for (int32_t t = 0; t < width; ++t) {
                const int32_t p = first + t;
                const float *vr = v + (int64_t)table[p / block_size] * s_blk +
                                  (int64_t)(p % block_size) * s_off + (int64_t)h * s_head;
                for (int32_t g = 0; g < G; ++g) {
                    const float w = scores[(int64_t)g * widest + t];
                    float *ag = acc + (int64_t)g * head_dim;
                    for (int32_t d = 0; d < head_dim; ++d) ag[d] += w * vr[d];
                }
            }
            for (int32_t g = 0; g < G; ++g) {
                const float inv = 1.0f / sum[g];
                for (int32_t d = 0; d < head_dim; ++d)
                    oh[(int64_t)g * head_dim + d] = acc[(int64_t)g * head_dim + d] * inv;
            }
        }
    }
    free(scores);
    free(acc);
    free(mx);
    free(sum);
    return 0;
}
