/* Paged decode attention on CPU, reading K/V blocks in place (no gather copy).
 *
 * One query token per sequence. For sequence s and KV head h, the G = num_heads / num_kv_heads
 * query heads of that group share one pass over the sequence's tokens:
 *
 *   token t lives in block block_tables[s][t / bs] at offset t % bs
 *   k(t) = key_cache + ((block * bs + t % bs) * num_kv_heads + h) * head_dim      (nbhd-v1 layout)
 *
 * Two passes per (s, h): scores for every visible token (then a max-subtracted softmax), then the
 * weighted sum of V. fp32 only; the torch path handles other dtypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void paged_decode_f32(const float *query,        /* [S, H, D] */
                      const float *key_cache,    /* [NB, BS, KVH, D] */
                      const float *value_cache,  /* [NB, BS, KVH, D] */
                      const int32_t *block_tables, /* [S, MAXB] */
                      const int32_t *context_lens, /* [S] */
                      float *out,                /* [S, H, D] */
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float scale, int64_t window,
                      int64_t max_context, int num_threads) {
    const int64_t groups = num_heads / num_kv_heads;
    const int64_t tasks = num_seqs * num_kv_heads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *scores = (float *)malloc(sizeof(float) * groups * (max_context > 0 ? max_context : 1));
        float *acc = (float *)malloc(sizeof(float) * groups * head_dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / num_kv_heads, h = task % num_kv_heads;
            const int64_t len = context_lens[s];
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const int32_t *table = block_tables + s * max_blocks;
            const float *q = query + (s * num_heads + h * groups) * head_dim;
            for (int64_t t = first; t < len; t++) {
                const float *k = key_cache + (((int64_t)table[t / block_size] * block_size + t % block_size)
                                              * num_kv_heads + h) * head_dim;
                for (int64_t g = 0; g < groups; g++) {
                    const float *qg = q + g * head_dim;
                    float dot = 0.f;
                    for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                    scores[g * max_context + t] = dot * scale;
                }
            }
            memset(acc, 0, sizeof(float) * groups * head_dim);
            for (int64_t g = 0; g < groups; g++) {
                float *sg = scores + g * max_context;
                float m = -INFINITY, total = 0.f;
                for (int64_t t = first; t < len; t++) m = sg[t] > m ? sg[t] : m;
                for (int64_t t = first; t < len; t++) { sg[t] = expf(sg[t] - m); total += sg[t]; }
                const float inv = total > 0.f ? 1.f / total : 0.f;
                for (int64_t t = first; t < len; t++) sg[t] *= inv;
            }
            for (int64_t t = first; t < len; t++) {
                const float *v = value_cache + (((int64_t)table[t / block_size] * block_size + t % block_size)
                                                * num_kv_heads + h) * head_dim;
                for (int64_t g = 0; g < groups; g++) {
                    const float p = scores[g * max_context + t];
                    float *a = acc + g * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                }
            }
            for (int64_t g = 0; g < groups; g++)
                memcpy(out + (s * num_heads + h * groups + g) * head_dim, acc + g * head_dim,
                       sizeof(float) * head_dim);
        }
        free(scores);
        free(acc);
    }
}
