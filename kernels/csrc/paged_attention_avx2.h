// The CPU paged-attention kernel's decode path for AVX2 machines (no AVX-512), included by
// paged_attention_cpu.cpp. One item is one decode row's KV head: its G query heads read each K and
// V row of the window once. 8-float vectors, sized to AVX2's 16 registers:
//
//   scores: per key, G accumulators (one per query head) over the row's D / 8 vectors, the query
//           read from L1; every 8 keys the 8 x G partial vectors reduce to G vectors of 8 scores
//   values: D in slices of S vectors, G x S accumulators in registers (G x S <= 12) across the
//           chunk's keys, each V row's slice loaded (and widened) once for the G updates
//
// Cache rows are fp32, bf16 or int8 with their scale (kernels/kv_int8.py); all arithmetic is fp32.
// An int8 row's scale multiplies its 8-key score vector and its value weights, never the values.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "paged_attention_common.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvx2Decode = true;

inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16 *p) {  // bf16 is an fp32's top half
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline __m256 load8(const int8_t *p) {
  int64_t bytes;
  std::memcpy(&bytes, p, sizeof bytes);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
}

// lane i = the sum of x[i]'s 8 lanes
inline __m256 hsum8(const __m256 *x) {
  const __m256 a = _mm256_hadd_ps(x[0], x[1]), b = _mm256_hadd_ps(x[2], x[3]);
  const __m256 c = _mm256_hadd_ps(x[4], x[5]), d = _mm256_hadd_ps(x[6], x[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // lanes: x0 x1 x2 x3 | x0 x1 x2 x3 (halves)
  const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20), hi = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(lo, hi);
}

// The rows of one KV head in a block, asked for ahead of use (blocks lie anywhere in the pool).
template <typename C>
inline void prefetch_head_rows(const C *row, int64_t rows, int64_t row_bytes, int64_t token_stride) {
  for (int64_t i = 0; i < rows; ++i, row += token_stride)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char *>(row) + b);
}

// Scratch: scores [kG][kKeyChunk], then (after them) weights [kG][kKeyChunk], q [kG][kD], acc [kG][kD].
template <typename T, typename C, int kD, int kG>
void decode_item_avx2(const Problem &p, const Item &it, const T *query, const C *kc, const C *vc, T *out,
                      float *scratch) {
  constexpr int NV = kD / 8;                                               // vectors in a row
  constexpr int S = std::min(NV, kG <= 1 ? 8 : kG <= 3 ? 4 : kG <= 6 ? 2 : 1);  // value slice, G x S <= 12
  constexpr int64_t row_len = kD + kRowExtra<C>;
  const int64_t bs = p.block_size, token_stride = p.num_kv_heads * row_len;
  const int64_t row = p.starts[it.seq], pos = p.lens[it.seq] - 1;
  const int32_t *table = p.tables + it.seq * p.max_blocks;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float *scores = scratch, *weights = scratch + kG * kKeyChunk;
  float *q = weights + kG * kKeyChunk, *acc = q + kG * kD;
  float row_max[kG], row_sum[kG], kscale[8];
  for (int g = 0; g < kG; ++g) {
    const T *src = query + row * p.q_stride0 + (it.kv_head * kG + g) * p.q_stride1;
    for (int d = 0; d < kD; ++d) q[g * kD + d] = static_cast<float>(src[d]) * p.scale;
    std::fill(acc + g * kD, acc + (g + 1) * kD, 0.f);
    row_max[g] = neg_inf;
    row_sum[g] = 0.f;
  }
  const int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  for (int64_t c0 = key_lo; c0 <= pos; c0 += kKeyChunk) {
    const int64_t c1 = std::min(pos + 1, c0 + kKeyChunk), n = c1 - c0;
    __m256 partial[kG][8];
    for (int64_t t = c0; t < c1;) {  // scores, one block run at a time
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const C *k = kc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * row_len;
      if (offset + run == bs && t + run <= pos) {  // the next block's rows of this head, K and V
        const int64_t next = (static_cast<int64_t>(table[block + 1]) * bs * p.num_kv_heads + it.kv_head) * row_len;
        prefetch_head_rows(kc + next, bs, row_len * sizeof(C), token_stride);
      }
      prefetch_head_rows(vc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * row_len, run,
                         row_len * sizeof(C), token_stride);
      for (int64_t i = 0; i < run; ++i, ++t, k += token_stride) {
        const int lane = static_cast<int>((t - c0) & 7);
        __m256 a[kG];
        for (int g = 0; g < kG; ++g) a[g] = _mm256_setzero_ps();
        for (int v = 0; v < NV; ++v) {
          const __m256 kv = load8(k + 8 * v);
          for (int g = 0; g < kG; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * kD + 8 * v), kv, a[g]);
        }
        for (int g = 0; g < kG; ++g) partial[g][lane] = a[g];
        kscale[lane] = row_scale(k, kD);
        if (lane == 7 || t + 1 == c1) {  // 8 keys, or the chunk's last ones
          for (int l = lane + 1; l < 8; ++l) {
            kscale[l] = 0.f;
            for (int g = 0; g < kG; ++g) partial[g][l] = _mm256_setzero_ps();
          }
          const __m256 ks = _mm256_loadu_ps(kscale);
          float *dst = scores + (t - c0 - lane);
          for (int g = 0; g < kG; ++g) {
            __m256 sums = hsum8(partial[g]);
            if constexpr (std::is_same_v<C, int8_t>) sums = _mm256_mul_ps(sums, ks);
            if (lane == 7) _mm256_storeu_ps(dst + g * kKeyChunk, sums);
            else {
              float tmp[8];
              _mm256_storeu_ps(tmp, sums);
              for (int j = 0; j <= lane; ++j) dst[g * kKeyChunk + j] = tmp[j];
            }
          }
        }
      }
    }
    for (int g = 0; g < kG; ++g) {  // online softmax over the chunk
      const float correction = decode_softmax_chunk(scores + g * kKeyChunk, n, p.softcap, row_max[g], row_sum[g]);
      if (correction != 1.f)
        for (int d = 0; d < kD; ++d) acc[g * kD + d] *= correction;
    }
    const float *w = scores;
    if constexpr (std::is_same_v<C, int8_t>) {  // fold each V row's scale into its weights
      for (int64_t t = c0; t < c1;) {
        const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
        const C *v = vc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * row_len;
        for (int64_t i = 0; i < run; ++i, ++t, v += token_stride) {
          const float vs = row_scale(v, kD);
          for (int g = 0; g < kG; ++g) weights[g * kKeyChunk + (t - c0)] = scores[g * kKeyChunk + (t - c0)] * vs;
        }
      }
      w = weights;
    }
    for (int s0 = 0; s0 < NV; s0 += S) {  // values, one slice of S vectors at a time
      __m256 a[kG][S];
      for (int g = 0; g < kG; ++g)
        for (int v = 0; v < S; ++v) a[g][v] = _mm256_loadu_ps(acc + g * kD + 8 * (s0 + v));
      for (int64_t t = c0; t < c1;) {
        const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
        const C *vrow = vc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * row_len + 8 * s0;
        for (int64_t i = 0; i < run; ++i, ++t, vrow += token_stride) {
          __m256 vv[S];
          for (int v = 0; v < S; ++v) vv[v] = load8(vrow + 8 * v);
          for (int g = 0; g < kG; ++g) {
            const __m256 wg = _mm256_broadcast_ss(w + g * kKeyChunk + (t - c0));
            for (int v = 0; v < S; ++v) a[g][v] = _mm256_fmadd_ps(wg, vv[v], a[g][v]);
          }
        }
      }
      for (int g = 0; g < kG; ++g)
        for (int v = 0; v < S; ++v) _mm256_storeu_ps(acc + g * kD + 8 * (s0 + v), a[g][v]);
    }
  }
  for (int g = 0; g < kG; ++g) {
    const float inv = 1.f / row_sum[g];  // > 0: the row sees its own key
    T *dst = out + (row * p.num_heads + it.kv_head * kG + g) * kD;
    for (int d = 0; d < kD; ++d) dst[d] = static_cast<T>(acc[g * kD + d] * inv);
  }
}

template <typename T, typename C>
using Avx2DecodeFn = void (*)(const Problem &, const Item &, const T *, const C *, const C *, T *, float *);

// Scratch floats one item needs (scores, weights, q, acc) for the largest group and head size.
constexpr int64_t kAvx2Scratch = 8 * kKeyChunk * 2 + 8 * 128 * 2;

template <typename T, typename C, int kD>
Avx2DecodeFn<T, C> avx2_decode_for(int64_t G) {
  switch (G) {
    case 1: return &decode_item_avx2<T, C, kD, 1>;
    case 2: return &decode_item_avx2<T, C, kD, 2>;
    case 3: return &decode_item_avx2<T, C, kD, 3>;
    case 4: return &decode_item_avx2<T, C, kD, 4>;
    case 5: return &decode_item_avx2<T, C, kD, 5>;
    case 6: return &decode_item_avx2<T, C, kD, 6>;
    case 7: return &decode_item_avx2<T, C, kD, 7>;
    case 8: return &decode_item_avx2<T, C, kD, 8>;
    default: return nullptr;
  }
}

// The AVX2 decode for this problem's shape and dtypes, or nullptr (fp16, other head sizes or groups).
template <typename T, typename C, int kD>
Avx2DecodeFn<T, C> avx2_decode_fn(const Problem &p) {
  constexpr bool cache_ok = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16> || std::is_same_v<C, int8_t>;
  constexpr bool query_ok = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  if constexpr (cache_ok && query_ok && (kD == 32 || kD == 64 || kD == 128)) {
    return avx2_decode_for<T, C, kD>(p.num_heads / p.num_kv_heads);
  } else {
    return nullptr;
  }
}
#else
constexpr bool kAvx2Decode = false;
#endif

}  // namespace
