// Paged attention on CPU that reads K/V blocks in place: decodes and prefill chunks (over any
// cached context) of many sequences in one call, in torch's own thread pool (at::parallel_for).
//
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]-1, which are its last
// positions: row j sits at position context_lens[s] - q_len + j and sees the keys at positions
// p - window < k <= p (no lower bound without a window). Token t of a sequence lives in block
// block_tables[s][t / bs] at offset t % bs of the nbhd-v1 cache ([num_blocks, bs, KVH, D]):
//
//   k(t) = key_cache + ((block_tables[s][t / bs] * bs + t % bs) * KVH + h) * D
//
// One work item is (sequence, KV head, a tile of up to kQueryTile query rows); the G = H / KVH
// query heads of the group share every K/V row it reads. Keys go by in chunks of kKeyChunk with an
// online softmax (running max and sum per query row), so no padded copy and no [Q, T] score
// matrix is ever built. Items are handed out from an atomic counter, largest first: prefill tiles
// differ in cost by orders of magnitude, and at::parallel_for's static split would leave a thread idle.
// Accumulation is fp32 whatever the cache dtype. An int8 cache (nbhd-q8-v1, kernels/kv_int8.py)
// is read in place: a row's dot products and value updates take its scale once per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "paged_attention_avx2.h"
#include "paged_attention_common.h"
#include "paged_attention_decode.h"
#include "paged_attention_tiles.h"

namespace {

// kD: head_dim fixed at compile time (the common 32 / 64 / 128 / 256: loops unroll fully), 0: runtime.
// T: the query's and output's dtype; C: the cache's (T itself, or int8 rows with their scales).
template <typename T, int kD, typename C>
void run_item(const Problem &p, const Item &it, const T *query, const C *kc, const C *vc, T *out,
              Scratch &sc) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = kD > 0 ? kD : p.head_dim, bs = p.block_size;
  const int64_t rows = it.row1 - it.row0, nq = rows * G;
  const int64_t q_begin = p.starts[it.seq];
  const int64_t q_len = p.starts[it.seq + 1] - q_begin;
  const int64_t first_pos = p.lens[it.seq] - q_len + it.row0;  // position of the tile's first row
  const int32_t *table = p.tables + it.seq * p.max_blocks;
  const int64_t row_len = D + kRowExtra<C>;         // one (token, head) row of the cache
  const int64_t token_stride = p.num_kv_heads * row_len;  // from one token's K (or V) row to the next
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t j = 0; j < rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const T *src = query + (q_begin + it.row0 + j) * p.q_stride0 + (it.kv_head * G + g) * p.q_stride1;
      float *dst = sc.q.data() + (j * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * p.scale;
    }
  std::fill(sc.acc.begin(), sc.acc.begin() + nq * D, 0.f);
  std::fill(sc.row_max.begin(), sc.row_max.begin() + nq, neg_inf);
  std::fill(sc.row_sum.begin(), sc.row_sum.begin() + nq, 0.f);

  const int64_t last_pos = first_pos + rows - 1;
  const int64_t key_lo = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
  const int64_t key_hi = last_pos + 1;
  for (int64_t c0 = key_lo; c0 < key_hi; c0 += kKeyChunk) {
    const int64_t c1 = std::min(key_hi, c0 + kKeyChunk);
    if (nq >= kTransposedRows) {
      transposed_scores<C, kD>(p, sc, table, kc, it.kv_head, rows, G, first_pos, c0, c1);
    } else {
    // scores: each K row once for all nq query rows; one block-table lookup per block run
    for (int64_t t = c0; t < c1;) {
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const C *k = kc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * row_len;
      for (int64_t i = 0; i < run; ++i, ++t, k += token_stride) {
        const float ks = row_scale(k, D);  // 1 for a float cache
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t pos = first_pos + j;
          const bool visible = t <= pos && (p.window <= 0 || t > pos - p.window);
          float *s = sc.scores.data() + j * G * kKeyChunk + (t - c0);
          for (int64_t g = 0; g < G; ++g, s += kKeyChunk) {
            float v = neg_inf;
            if (visible) {
              v = dot(sc.q.data() + (j * G + g) * D, k, D) * ks;
              if (p.softcap > 0.f) v = p.softcap * std::tanh(v / p.softcap);
            }
            *s = v;
          }
        }
      }
    }
    }
    for (int64_t r = 0; r < nq; ++r) {  // online softmax: rescale what came before, weigh this chunk
      float *s = sc.scores.data() + r * kKeyChunk;
      float m = sc.row_max[r];
      for (int64_t t = 0; t < c1 - c0; ++t) m = std::max(m, s[t]);
      if (m == neg_inf) {  // nothing visible yet for this row (window, causal edge): weighs nothing
        std::fill(s, s + (c1 - c0), 0.f);
        continue;
      }
      const float correction = softmax_exp(sc.row_max[r] - m);
      float total = 0.f;
      for (int64_t t = 0; t < c1 - c0; ++t) {
        s[t] = softmax_exp(s[t] - m);
        total += s[t];
      }
      sc.row_sum[r] = sc.row_sum[r] * correction + total;
      sc.row_max[r] = m;
      if (correction != 1.f) {
        float *a = sc.acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= correction;
      }
    }
    if constexpr (kRegisterTiles && (kD == 32 || kD == 64 || kD == 128)) {
      if (nq >= kTransposedRows) {
        blocked_values<C, kD>(p, sc, table, vc, it.kv_head, nq, c0, c1);
        continue;
      }
    }
    for (int64_t t = c0; t < c1;) {  // values: each V row once for all nq query rows
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const C *v = vc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * row_len;
      for (int64_t i = 0; i < run; ++i, ++t, v += token_stride) {
        const float vs = row_scale(v, D);
        for (int64_t r = 0; r < nq; ++r) {
          const float w = sc.scores[r * kKeyChunk + (t - c0)];  // 0 where masked
          if (w != 0.f) axpy(w * vs, v, sc.acc.data() + r * D, D);
        }
      }
    }
  }
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = j * G + g;
      const float inv = 1.f / sc.row_sum[r];  // > 0: every row sees at least its own key
      T *dst = out + ((q_begin + it.row0 + j) * p.num_heads + it.kv_head * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sc.acc[r * D + d] * inv);
    }
}

// whole_decodes: a decode sequence is one item of all its KV heads (kv_head -1), for the register
// decode path only; with enough of them there is work for every thread without splitting by head.
std::vector<Item> work_items(const Problem &p, int64_t num_seqs, bool whole_decodes) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = p.starts[s + 1] - p.starts[s];
    if (whole_decodes && q_len == 1) {
      const int64_t keys = p.window > 0 ? std::min<int64_t>(p.lens[s], p.window) : p.lens[s];
      items.push_back({s, -1, 0, 1, keys * p.num_kv_heads});
      continue;
    }
    for (int64_t r0 = 0; r0 < q_len; r0 += kQueryTile) {
      const int64_t r1 = std::min(q_len, r0 + kQueryTile);
      const int64_t last = p.lens[s] - q_len + r1;  // keys up to the tile's last row
      const int64_t keys = p.window > 0 ? std::min(last, p.window + r1 - r0) : last;
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({s, h, r0, r1, (r1 - r0) * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item &a, const Item &b) { return a.cost > b.cost; });
  return items;
}

template <typename T, int kD, typename C>
void run_all(const Problem &p, int64_t num_seqs, const T *q, const C *kc, const C *vc, T *o) {
  constexpr bool register_decode = kRegisterDecode<T> && std::is_same_v<C, T>;  // float caches only
  DecodeFn<T> decode = nullptr;
  if constexpr (register_decode) decode = decode_fn<T, kD>(p);
#if defined(__AVX2__) && defined(__FMA__)
  // Decode rows without the register path (no AVX-512, or an int8 cache) take the 8-float path of
  // paged_attention_avx2.h.
  Avx2DecodeFn<T, C> avx2_decode = nullptr;
  if constexpr (!register_decode) avx2_decode = avx2_decode_fn<T, C, kD>(p);
#endif
  int64_t num_decodes = 0;
  for (int64_t s = 0; s < num_seqs; ++s) num_decodes += p.starts[s + 1] - p.starts[s] == 1;
  const std::vector<Item> items =
      work_items(p, num_seqs, decode != nullptr && num_decodes >= 2 * at::get_num_threads());
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(num_items, 1));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(kQueryTile * (p.num_heads / p.num_kv_heads), p.head_dim);
#if defined(__AVX2__) && defined(__FMA__)
    std::vector<float> avx2_scratch(avx2_decode != nullptr ? kAvx2Scratch : 0);
#endif
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item &it = items[i];
#if defined(__AVX2__) && defined(__FMA__)
      if (avx2_decode != nullptr && p.starts[it.seq + 1] - p.starts[it.seq] == 1) {
        avx2_decode(p, it, q, kc, vc, o, avx2_scratch.data());
        continue;
      }
#endif
      if constexpr (register_decode) {
        if (it.kv_head < 0) {  // a whole decode sequence (work_items made these only for this path)
          for (int64_t h = 0; h < p.num_kv_heads; ++h)
            decode(p, Item{it.seq, h, 0, 1, 0}, q, kc, vc, o, scratch.scores.data(), h == 0);
          continue;
        }
        if (decode != nullptr && it.row1 - it.row0 == 1 && p.starts[it.seq + 1] - p.starts[it.seq] == 1) {
          decode(p, it, q, kc, vc, o, scratch.scores.data(), false);
          continue;
        }
      }
      run_item<T, kD, C>(p, it, q, kc, vc, o, scratch);
    }
  });
}

template <typename T, typename C>
void dispatch_head_dim(const Problem &p, int64_t num_seqs, const T *q, const C *kc, const C *vc, T *o) {
  switch (p.head_dim) {
    case 32: return run_all<T, 32, C>(p, num_seqs, q, kc, vc, o);
    case 64: return run_all<T, 64, C>(p, num_seqs, q, kc, vc, o);
    case 128: return run_all<T, 128, C>(p, num_seqs, q, kc, vc, o);
    case 256: return run_all<T, 256, C>(p, num_seqs, q, kc, vc, o);
    default: return run_all<T, 0, C>(p, num_seqs, q, kc, vc, o);
  }
}

at::Tensor paged_attention(const at::Tensor &query, const at::Tensor &key_cache, const at::Tensor &value_cache,
                           const at::Tensor &block_tables, const at::Tensor &query_start_loc,
                           const at::Tensor &context_lens, double scale, int64_t window, double softcap) {
  // query: [T, H, D] (rows may be strided); caches: [NB, BS, KVH, D] contiguous;
  // block_tables: [S, MAXB] int32; query_start_loc: [S + 1] int32; context_lens: [S] int32
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with contiguous D");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] (nbhd-v1)");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches differ in dtype");
  const bool int8_cache = key_cache.scalar_type() == at::kChar;  // nbhd-q8-v1: int8 rows, fp32 scales
  TORCH_CHECK(int8_cache || query.scalar_type() == key_cache.scalar_type(),
              "query and caches must share one dtype (or the caches be int8 rows)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous(), "block_tables must be [S, MAXB] contiguous");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "one block table and one context length per sequence");
  TORCH_CHECK(query.size(2) + (int8_cache ? kRowExtra<int8_t> : 0) == key_cache.size(3) &&
                  query.size(1) % key_cache.size(2) == 0,
              "head_dim must match (int8 rows: head_dim + 4) and num_heads be a multiple of num_kv_heads");
  auto starts = query_start_loc.contiguous();
  auto lens = context_lens.contiguous();
  const Problem p{query.size(1), key_cache.size(2), query.size(2), key_cache.size(1), block_tables.size(1), window,
                  static_cast<float>(scale), static_cast<float>(softcap), query.stride(0), query.stride(1),
                  block_tables.data_ptr<int32_t>(), starts.data_ptr<int32_t>(), lens.data_ptr<int32_t>()};
  TORCH_CHECK(p.starts[0] == 0 && p.starts[num_seqs] == query.size(0), "query_start_loc must span the query rows");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = p.starts[s + 1] - p.starts[s];
    TORCH_CHECK(q_len >= 0 && q_len <= p.lens[s], "sequence ", s, ": more query rows than context");
    TORCH_CHECK(p.lens[s] <= p.max_blocks * p.block_size, "sequence ", s, ": context longer than its block table");
    for (int64_t b = 0; b < (p.lens[s] + p.block_size - 1) / p.block_size; ++b) {
      const int32_t id = p.tables[s * p.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < key_cache.size(0), "sequence ", s, ": block id ", id, " outside the cache");
    }
  }
  auto out = at::empty({query.size(0), p.num_heads, p.head_dim}, query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_cpu", [&] {
    const scalar_t *q = query.data_ptr<scalar_t>();
    scalar_t *o = out.data_ptr<scalar_t>();
    if (int8_cache)
      return dispatch_head_dim(p, num_seqs, q, key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>(), o);
    dispatch_head_dim(p, num_seqs, q, key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(), o);
  });
  return out;
}

// How many threads one at::parallel_for of this library really runs on: torch's thread count when
// the library is built with OpenMP, 1 when the header template compiled to its serial fallback.
int64_t parallel_width() {
  std::atomic<int64_t> widest{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t id = at::get_thread_num() + 1;
    for (int64_t seen = widest.load(); seen < id && !widest.compare_exchange_weak(seen, id);) {
    }
  });
  return widest.load();
}

bool register_tiles() { return kRegisterTiles; }

bool bf16_dot() { return kRegisterDecode<c10::BFloat16> && kBf16Dot<c10::BFloat16>; }

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, float scale, int window, float softcap) -> Tensor");
  m.def("parallel_width() -> int", &parallel_width);
  m.def("register_tiles() -> bool", &register_tiles);
  m.def("bf16_dot() -> bool", &bf16_dot);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
