// The CPU paged-attention kernel's decode path (included by paged_attention_cpu.cpp): one query
// row per item, the group's query heads and accumulators held in vector registers, the next
// blocks prefetched; decode_fn picks the instance for a problem's dtype, head size and group.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "paged_attention_common.h"

namespace {

// On CPUs with AVX512-BF16 a bf16 cache's keys meet the query in vdpbf16ps: 32 bf16 products a
// instruction, summed in pairs into 16 fp32 lanes, with no widening of the key row. A product of two
// bf16 values is exact in fp32, so the scores differ from the widened path's only in the order
// of the fp32 sums (and the instruction flushes denormals); the softmax scale, which need not be a
// power of two, is applied to the sums rather than to the bf16 query.
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kBf16Dot = std::is_same_v<T, c10::BFloat16>;

inline __m512bh load_bh32(const c10::BFloat16 *p) {
  __m512bh v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#else
template <typename T>
constexpr bool kBf16Dot = false;
#endif

// The general item above keeps its accumulators in scratch memory and runs for any rows, dtype and
// mask. A decode row sees every key of its window, so this one needs no mask: the group's query
// heads and output accumulators live in vector registers (kG x kD / 16 of each), each K row is
// loaded once for the kG dot products and each V row once for the kG updates. A bf16 cache's values
// are widened to fp32 as they are loaded, and its keys too where the CPU has no bf16 dot product
// (kBf16Dot above); the arithmetic is fp32 either way.

// The next block's rows of one KV head, asked for ahead of use: a sequence's blocks lie anywhere in
// the pool and a head's rows are strided (one token's heads side by side), which the hardware
// prefetcher does not follow from one block to the next.
template <typename T>
inline void prefetch_rows(const T *cache, int32_t block, const Problem &p, int64_t kv_head, int64_t d) {
  constexpr int64_t line = 64 / sizeof(T);  // values in one cache line
  const T *row = cache + (static_cast<int64_t>(block) * p.block_size * p.num_kv_heads + kv_head) * d;
  for (int64_t i = 0; i < p.block_size; ++i, row += p.num_kv_heads * d)
    for (int64_t b = 0; b < d; b += line) __builtin_prefetch(row + b);
}

// A whole block (every head's rows: one contiguous run of block_size x KVH x D values).
template <typename T>
inline void prefetch_block(const T *cache, int32_t block, const Problem &p, int64_t d) {
  constexpr int64_t line = 64 / sizeof(T);
  const T *start = cache + static_cast<int64_t>(block) * p.block_size * p.num_kv_heads * d;
  for (int64_t b = 0; b < p.block_size * p.num_kv_heads * d; b += line) __builtin_prefetch(start + b);
}

// whole_blocks: this call is the first head of a sequence whose other heads follow on this thread;
// it prefetches whole blocks (all heads' rows, contiguous), so that the later heads find their rows
// in cache and DRAM streams each block in one run rather than in strided thirds.
template <typename T, int kD, int kG>
void decode_item(const Problem &p, const Item &it, const T *query, const T *kc, const T *vc, T *out,
                 float *scores /* [kG][kKeyChunk] */, bool whole_blocks) {
  constexpr int NV = kD / 16;
  constexpr bool kDot = kBf16Dot<T>;
  const float score_scale = kDot ? p.scale : 1.f;  // kDot: the query goes in unscaled
  const int64_t bs = p.block_size, token_stride = p.num_kv_heads * kD;
  const int64_t row = p.starts[it.seq], pos = p.lens[it.seq] - 1;
  const int32_t *table = p.tables + it.seq * p.max_blocks;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vf16 q[kG][NV], acc[kG][NV];
#if defined(__AVX512BF16__)
  __m512bh qb[kG][kDot ? kD / 32 : 1];  // kDot: the query's bf16 values, 32 to a register
#endif
  vf16 partial[kG][16] = {};  // each key's products, one vector a (head, key), before hsum16
  float row_max[kG], row_sum[kG];
  for (int g = 0; g < kG; ++g) {
    const T *src = query + row * p.q_stride0 + (it.kv_head * kG + g) * p.q_stride1;
    for (int v = 0; v < NV; ++v) {
      if constexpr (!kDot) q[g][v] = load_vf16(src + 16 * v) * p.scale;
      acc[g][v] = vf16{} ;
    }
#if defined(__AVX512BF16__)
    if constexpr (kDot)
      for (int v = 0; v < kD / 32; ++v) qb[g][v] = load_bh32(src + 32 * v);
#endif
    row_max[g] = neg_inf;
    row_sum[g] = 0.f;
  }
  const int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  for (int64_t c0 = key_lo; c0 <= pos; c0 += kKeyChunk) {
    const int64_t c1 = std::min(pos + 1, c0 + kKeyChunk), n = c1 - c0;
    for (int64_t t = c0; t < c1;) {  // scores, one block run at a time
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const T *k = kc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * kD;
      if (whole_blocks) {  // two blocks ahead: one block's compute is shorter than a DRAM round trip
        if (t + run + bs <= pos) prefetch_block(kc, table[block + 2], p, kD);
        prefetch_block(vc, table[block], p, kD);  // for the values pass after this chunk
      } else {
        if (t + run <= pos) prefetch_rows(kc, table[block + 1], p, it.kv_head, kD);
        prefetch_rows(vc, table[block], p, it.kv_head, kD);
      }
      for (int64_t i = 0; i < run; ++i, ++t, k += token_stride) {
        const int64_t lane = (t - c0) & 15;  // keys go by 16 at a time into one vector of scores
        if constexpr (kDot) {
#if defined(__AVX512BF16__)
          __m512bh kb[kD / 32];
          for (int v = 0; v < kD / 32; ++v) kb[v] = load_bh32(k + 32 * v);
          for (int g = 0; g < kG; ++g) {
            __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kb[0]);
            for (int v = 1; v < kD / 32; ++v) d = _mm512_dpbf16_ps(d, qb[g][v], kb[v]);
            std::memcpy(&partial[g][lane], &d, sizeof d);
          }
#endif
        } else {
          vf16 kv[NV];
          for (int v = 0; v < NV; ++v) kv[v] = load_vf16(k + 16 * v);
          for (int g = 0; g < kG; ++g) {
            vf16 d = q[g][0] * kv[0];
            for (int v = 1; v < NV; ++v) d += q[g][v] * kv[v];
            partial[g][lane] = d;
          }
        }
        if (lane == 15 || t + 1 == c1) {  // a full 16, or the chunk's last keys
          float *dst = scores + (t - c0 - lane);
          for (int g = 0; g < kG; ++g, dst += kKeyChunk) {
            const vf16 sums = hsum16(partial[g]) * score_scale;
            if (lane == 15) store_vf16(dst, sums);
            else for (int64_t j = 0; j <= lane; ++j) dst[j] = sums[j];
          }
        }
      }
    }
    for (int g = 0; g < kG; ++g) {  // online softmax over the chunk
      const float correction = decode_softmax_chunk(scores + g * kKeyChunk, n, p.softcap, row_max[g], row_sum[g]);
      for (int v = 0; v < NV; ++v) acc[g][v] *= correction;
    }
    for (int64_t t = c0; t < c1;) {  // values
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const T *vrow = vc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * kD;
      for (int64_t i = 0; i < run; ++i, ++t, vrow += token_stride) {
        vf16 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load_vf16(vrow + 16 * v);
        for (int g = 0; g < kG; ++g) {
          const float w = scores[g * kKeyChunk + (t - c0)];
          for (int v = 0; v < NV; ++v) acc[g][v] += w * vv[v];
        }
      }
    }
  }
  for (int g = 0; g < kG; ++g) {
    const float inv = 1.f / row_sum[g];  // > 0: the row sees its own key
    T *dst = out + (row * p.num_heads + it.kv_head * kG + g) * kD;
    for (int v = 0; v < NV; ++v) store_vf16(dst + 16 * v, acc[g][v] * inv);
  }
}

template <typename T>
using DecodeFn = void (*)(const Problem &, const Item &, const T *, const T *, const T *, T *, float *, bool);

template <typename T>
constexpr bool kRegisterDecode = kRegisterTiles && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);

template <typename T, int kD>
DecodeFn<T> decode_fn_for(int64_t G) {
  switch (G) {
    case 1: return &decode_item<T, kD, 1>;
    case 2: return &decode_item<T, kD, 2>;
    case 3: return &decode_item<T, kD, 3>;
    case 4: return &decode_item<T, kD, 4>;
    case 5: return &decode_item<T, kD, 5>;
    case 6: return &decode_item<T, kD, 6>;
    case 7: return &decode_item<T, kD, 7>;
    case 8: return &decode_item<T, kD, 8>;
    default: return nullptr;
  }
}

// The register-held decode for this problem's shape, or nullptr (fp16, other head sizes, groups).
template <typename T, int kD>
DecodeFn<T> decode_fn(const Problem &p) {
  if constexpr (kRegisterDecode<T> && (kD == 32 || kD == 64 || kD == 128)) {
    return decode_fn_for<T, kD>(p.num_heads / p.num_kv_heads);
  } else {
    return nullptr;
  }
}

}  // namespace
