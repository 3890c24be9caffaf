// The CPU paged-attention kernel's register tiles for prefill rows (included by
// paged_attention_cpu.cpp): scores against a chunk's keys transposed, and P.V as a small GEMM.
// Compiled in where AVX-512 holds the tiles' vectors (kRegisterTiles, paged_attention_common.h).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "paged_attention_common.h"

namespace {

// From this many query rows in an item (prefill tiles), scores are computed against the chunk's
// keys transposed to [D, keys]: the products then vectorise across keys, with no horizontal sum
// per (row, key); the transpose costs one pass over the chunk, which few rows would not repay.
// (kRegisterTiles: only where AVX-512 holds the tiles' vectors, paged_attention_common.h)
constexpr int64_t kTransposedRows = kRegisterTiles ? 8 : std::numeric_limits<int64_t>::max();

template <typename C, int kD>
void transposed_scores(const Problem &p, Scratch &sc, const int32_t *table, const C *kc, int64_t kv_head,
                       int64_t rows, int64_t G, int64_t first_pos, int64_t c0, int64_t c1) {
  const int64_t D = kD > 0 ? kD : p.head_dim, n = c1 - c0, bs = p.block_size, row_len = D + kRowExtra<C>;
  const int64_t token_stride = p.num_kv_heads * row_len;
  const int64_t nq = rows * G;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float *kt = sc.keys_t.data();  // [D, kKeyChunk]; columns past n hold stale values, never kept
  for (int64_t t = c0; t < c1;) {
    const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
    const C *k = kc + ((table[block] * bs + offset) * p.num_kv_heads + kv_head) * row_len;
    for (int64_t i = 0; i < run; ++i, ++t, k += token_stride) {
      const float ks = row_scale(k, D);
      for (int64_t d = 0; d < D; ++d) kt[d * kKeyChunk + (t - c0)] = static_cast<float>(k[d]) * ks;
    }
  }
  // A register tile of 8 query rows x 32 keys (16 vector accumulators): each d loads two vectors
  // of keys and feeds them 16 multiply-adds. Rows past the last multiple of 8 take the 4 x 16 tile.
  int64_t full = 0;
  for (; full + 8 <= nq; full += 8) {
    for (int64_t t0 = 0; t0 < n; t0 += 32) {
      vf16 acc[8][2] = {};
      for (int64_t d = 0; d < D; ++d) {
        const vf16 k0 = load_vf16(kt + d * kKeyChunk + t0), k1 = load_vf16(kt + d * kKeyChunk + t0 + 16);
        for (int r = 0; r < 8; ++r) {
          const float qd = sc.q[(full + r) * D + d];
          acc[r][0] += qd * k0;
          acc[r][1] += qd * k1;
        }
      }
      const int64_t w = std::min<int64_t>(32, n - t0);
      for (int r = 0; r < 8; ++r) {
        float *dst = sc.scores.data() + (full + r) * kKeyChunk + t0;
        if (w == 32) {
          store_vf16(dst, acc[r][0]);
          store_vf16(dst + 16, acc[r][1]);
        } else {
          for (int64_t i = 0; i < w; ++i) dst[i] = i < 16 ? acc[r][0][i] : acc[r][1][i - 16];
        }
      }
    }
  }
  constexpr int64_t R = 4, W = 16;
  for (int64_t r0 = full; r0 < nq; r0 += R) {
    const int64_t nr = std::min(R, nq - r0);
    for (int64_t t0 = 0; t0 < n; t0 += W) {
      float acc[R][W] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float *col = kt + d * kKeyChunk + t0;
        for (int64_t r = 0; r < R; ++r) {
          const float qd = r < nr ? sc.q[(r0 + r) * D + d] : 0.f;
          for (int64_t i = 0; i < W; ++i) acc[r][i] += qd * col[i];
        }
      }
      const int64_t w = std::min(W, n - t0);
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t i = 0; i < w; ++i) sc.scores[(r0 + r) * kKeyChunk + t0 + i] = acc[r][i];
    }
  }
  for (int64_t j = 0; j < rows; ++j) {  // causal and window mask, soft-capping
    const int64_t pos = first_pos + j;
    const int64_t lo = std::max<int64_t>(c0, p.window > 0 ? pos - p.window + 1 : c0) - c0;
    const int64_t hi = std::min<int64_t>(c1, pos + 1) - c0;  // visible keys: [lo, hi) of the chunk
    for (int64_t g = 0; g < G; ++g) {
      float *s = sc.scores.data() + (j * G + g) * kKeyChunk;
      for (int64_t t = 0; t < n; ++t) {
        if (t < lo || t >= hi) s[t] = neg_inf;
        else if (p.softcap > 0.f) s[t] = p.softcap * std::tanh(s[t] / p.softcap);
      }
    }
  }
}


// P.V of a prefill tile's chunk as a small GEMM: the chunk's V rows are copied once into a
// contiguous [keys, D] buffer, then for every 4 query rows the 4 x D accumulators stay in vector
// registers across all the chunk's keys (each V row loaded once per 4 rows, 4 x D/16 FMAs on it).
// Masked keys weigh exactly 0 (the softmax wrote them so), which adds nothing.
template <typename C, int kD>
void blocked_values(const Problem &p, Scratch &sc, const int32_t *table, const C *vc, int64_t kv_head, int64_t nq,
                    int64_t c0, int64_t c1) {
  constexpr int NV = kD / 16, R = 4;
  constexpr int64_t row_len = kD + kRowExtra<C>;
  const int64_t n = c1 - c0, bs = p.block_size, token_stride = p.num_kv_heads * row_len;
  float *vbuf = sc.values.data();
  for (int64_t t = c0; t < c1;) {
    const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
    const C *v = vc + ((table[block] * bs + offset) * p.num_kv_heads + kv_head) * row_len;
    for (int64_t i = 0; i < run; ++i, ++t, v += token_stride) {
      const float vs = row_scale(v, kD);
      for (int64_t d = 0; d < kD; ++d) vbuf[(t - c0) * kD + d] = static_cast<float>(v[d]) * vs;
    }
  }
  int64_t r0 = 0;
  for (; r0 + R <= nq; r0 += R) {
    vf16 a[R][NV];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) a[r][v] = load_vf16(sc.acc.data() + (r0 + r) * kD + 16 * v);
    const float *w0 = sc.scores.data() + r0 * kKeyChunk;
    for (int64_t t = 0; t < n; ++t) {
      vf16 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load_vf16(vbuf + t * kD + 16 * v);
      for (int r = 0; r < R; ++r) {
        const float w = w0[r * kKeyChunk + t];
        for (int v = 0; v < NV; ++v) a[r][v] += w * vv[v];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) store_vf16(sc.acc.data() + (r0 + r) * kD + 16 * v, a[r][v]);
  }
  for (; r0 < nq; ++r0)  // the last nq % 4 rows
    for (int64_t t = 0; t < n; ++t) {
      const float w = sc.scores[r0 * kKeyChunk + t];
      if (w != 0.f) axpy(w, vbuf + t * kD, sc.acc.data() + r0 * kD, kD);
    }
}

}  // namespace
