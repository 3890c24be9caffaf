// Shared by the CPU paged-attention kernel's paths (paged_attention_cpu.cpp): 16-float vectors
// and their loads and stores in fp32 and bf16, the horizontal sums of 16 vectors at once, a call's
// problem and work item, the cache's rows (float, or int8 with a scale) and an item's scratch.
// Included by that one translation unit (internal linkage).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

using pdserve::softmax_exp;

// GCC vector types: AVX-512 registers here, split into narrower ones where -march has none.
typedef float vf16 __attribute__((vector_size(64)));

// The register-tiled paths (prefill score and value tiles, the decode items) keep up to 16
// vectors of 16 floats live: AVX-512's 32 registers hold them. With only 256-bit registers
// (AVX2: 16 of them) GCC keeps such vectors in memory, and on an AVX2 machine those paths ran
// 5x (prefill) and 2x (decode) slower than the plain loops, which vectorise at the native width;
// so they are compiled in only with AVX-512 (bench/notes/cpu-attention.md).
#if defined(__AVX512F__)
constexpr bool kRegisterTiles = true;
#else
constexpr bool kRegisterTiles = false;
#endif

inline vf16 load_vf16(const float *p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_vf16(float *p, vf16 v) { std::memcpy(p, &v, sizeof v); }

// bf16 is the top half of an fp32: 16 of them widen to floats with one zero-extend and a shift.
typedef uint16_t vu16x16 __attribute__((vector_size(32)));
typedef uint32_t vu32x16 __attribute__((vector_size(64)));

inline vf16 load_vf16(const c10::BFloat16 *p) {
  vu16x16 half;
  std::memcpy(&half, p, sizeof half);
  const vu32x16 wide = __builtin_convertvector(half, vu32x16) << 16;
  vf16 v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// Rounds to nearest even, as torch's own bf16 conversion does (only the output row takes this).
inline void store_vf16(c10::BFloat16 *p, vf16 v) {
  for (int i = 0; i < 16; ++i) p[i] = static_cast<c10::BFloat16>(v[i]);
}

// The horizontal sums of 16 vectors at once, lane i of the result = the sum of x[i]'s lanes: each level adds
// the two halves of every vector while packing two vectors into one (16 -> 8 -> 4 -> 2 -> 1), so
// 16 dot products cost 15 shuffle pairs and adds instead of 16 serial lane-by-lane sums.
inline vf16 hsum16(const vf16 *x) {
  vf16 y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  for (int i = 0; i < 4; ++i)
    z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

constexpr int64_t kQueryTile = 16;  // query rows of one sequence per work item
constexpr int64_t kKeyChunk = 128;  // keys per online-softmax step

struct Item {
  int64_t seq, kv_head, row0, row1;  // rows are offsets in the sequence's own query rows
  int64_t cost;                      // rows x keys visited, for largest-first ordering
};

struct Problem {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
  float scale, softcap;
  int64_t q_stride0, q_stride1;
  const int32_t *tables, *starts, *lens;
};

template <typename T>
inline float dot(const float *q, const T *k, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T *v, float *acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * static_cast<float>(v[i]);
}

// A cache of int8 rows (layout nbhd-q8-v1, kernels/kv_int8.py): each (token, KV head) row is D int8
// values and then its fp32 scale's 4 bytes; a float cache's rows are the D values alone.
template <typename C>
constexpr int64_t kRowExtra = std::is_same_v<C, int8_t> ? 4 : 0;

template <typename C>
inline float row_scale(const C *row, int64_t d) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, row + d, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}

// A decode row's chunk of n scores, soft-capped where the model caps, then weighed by the online
// softmax: s[t] becomes exp(s[t] - max), the row's running max and sum move on, and the returned
// factor rescales what the row accumulated before this chunk. (A decode row sees its own key, so
// its max is finite from the first chunk on.)
inline float decode_softmax_chunk(float *s, int64_t n, float softcap, float &row_max, float &row_sum) {
  if (softcap > 0.f)
    for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  float m = row_max;
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  const float correction = softmax_exp(row_max - m);
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = softmax_exp(s[t] - m);
    total += s[t];
  }
  row_sum = row_sum * correction + total;
  row_max = m;
  return correction;
}

struct Scratch {
  std::vector<float> q, scores, acc, row_max, row_sum, keys_t, values;
  Scratch(int64_t nq, int64_t d)
      : q(nq * d), scores(nq * kKeyChunk), acc(nq * d), row_max(nq), row_sum(nq), keys_t(d * kKeyChunk),
        values(kKeyChunk * d) {}
};

}  // namespace
