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
// Accumulation is fp32 whatever the cache dtype.
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
#include "paged_attention_common.h"
#include "paged_attention_decode.h"

namespace {

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

struct Scratch {
  std::vector<float> q, scores, acc, row_max, row_sum, keys_t, values;
  Scratch(int64_t nq, int64_t d)
      : q(nq * d), scores(nq * kKeyChunk), acc(nq * d), row_max(nq), row_sum(nq), keys_t(d * kKeyChunk),
        values(kKeyChunk * d) {}
};

// From this many query rows in an item (prefill tiles), scores are computed against the chunk's
// keys transposed to [D, keys]: the products then vectorise across keys, with no horizontal sum
// per (row, key); the transpose costs one pass over the chunk, which few rows would not repay.
// (kRegisterTiles: only where AVX-512 holds the tiles' vectors, paged_attention_common.h)
constexpr int64_t kTransposedRows = kRegisterTiles ? 8 : std::numeric_limits<int64_t>::max();

template <typename T, int kD>
void transposed_scores(const Problem &p, Scratch &sc, const int32_t *table, const T *kc, int64_t kv_head,
                       int64_t rows, int64_t G, int64_t first_pos, int64_t c0, int64_t c1) {
  const int64_t D = kD > 0 ? kD : p.head_dim, n = c1 - c0, bs = p.block_size, token_stride = p.num_kv_heads * D;
  const int64_t nq = rows * G;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float *kt = sc.keys_t.data();  // [D, kKeyChunk]; columns past n hold stale values, never kept
  for (int64_t t = c0; t < c1;) {
    const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
    const T *k = kc + ((table[block] * bs + offset) * p.num_kv_heads + kv_head) * D;
    for (int64_t i = 0; i < run; ++i, ++t, k += token_stride)
      for (int64_t d = 0; d < D; ++d) kt[d * kKeyChunk + (t - c0)] = static_cast<float>(k[d]);
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
template <typename T, int kD>
void blocked_values(const Problem &p, Scratch &sc, const int32_t *table, const T *vc, int64_t kv_head, int64_t nq,
                    int64_t c0, int64_t c1) {
  constexpr int NV = kD / 16, R = 4;
  const int64_t n = c1 - c0, bs = p.block_size, token_stride = p.num_kv_heads * kD;
  float *vbuf = sc.values.data();
  for (int64_t t = c0; t < c1;) {
    const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
    const T *v = vc + ((table[block] * bs + offset) * p.num_kv_heads + kv_head) * kD;
    for (int64_t i = 0; i < run; ++i, ++t, v += token_stride)
      for (int64_t d = 0; d < kD; ++d) vbuf[(t - c0) * kD + d] = static_cast<float>(v[d]);
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

// kD: head_dim fixed at compile time (the common 32 / 64 / 128 / 256: loops unroll fully), 0: runtime.
template <typename T, int kD>
void run_item(const Problem &p, const Item &it, const T *query, const T *kc, const T *vc, T *out,
              Scratch &sc) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = kD > 0 ? kD : p.head_dim, bs = p.block_size;
  const int64_t rows = it.row1 - it.row0, nq = rows * G;
  const int64_t q_begin = p.starts[it.seq];
  const int64_t q_len = p.starts[it.seq + 1] - q_begin;
  const int64_t first_pos = p.lens[it.seq] - q_len + it.row0;  // position of the tile's first row
  const int32_t *table = p.tables + it.seq * p.max_blocks;
  const int64_t token_stride = p.num_kv_heads * D;  // from one token's K (or V) row to the next
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
      transposed_scores<T, kD>(p, sc, table, kc, it.kv_head, rows, G, first_pos, c0, c1);
    } else {
    // scores: each K row once for all nq query rows; one block-table lookup per block run
    for (int64_t t = c0; t < c1;) {
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const T *k = kc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * D;
      for (int64_t i = 0; i < run; ++i, ++t, k += token_stride)
        for (int64_t j = 0; j < rows; ++j) {
          const int64_t pos = first_pos + j;
          const bool visible = t <= pos && (p.window <= 0 || t > pos - p.window);
          float *s = sc.scores.data() + j * G * kKeyChunk + (t - c0);
          for (int64_t g = 0; g < G; ++g, s += kKeyChunk) {
            float v = neg_inf;
            if (visible) {
              v = dot(sc.q.data() + (j * G + g) * D, k, D);
              if (p.softcap > 0.f) v = p.softcap * std::tanh(v / p.softcap);
            }
            *s = v;
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
        blocked_values<T, kD>(p, sc, table, vc, it.kv_head, nq, c0, c1);
        continue;
      }
    }
    for (int64_t t = c0; t < c1;) {  // values: each V row once for all nq query rows
      const int64_t block = t / bs, offset = t - block * bs, run = std::min(c1 - t, bs - offset);
      const T *v = vc + ((table[block] * bs + offset) * p.num_kv_heads + it.kv_head) * D;
      for (int64_t i = 0; i < run; ++i, ++t, v += token_stride)
        for (int64_t r = 0; r < nq; ++r) {
          const float w = sc.scores[r * kKeyChunk + (t - c0)];  // 0 where masked
          if (w != 0.f) axpy(w, v, sc.acc.data() + r * D, D);
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

template <typename T, int kD>
void run_all(const Problem &p, int64_t num_seqs, const T *q, const T *kc, const T *vc, T *o) {
  const DecodeFn<T> decode = decode_fn<T, kD>(p);
  int64_t num_decodes = 0;
  for (int64_t s = 0; s < num_seqs; ++s) num_decodes += p.starts[s + 1] - p.starts[s] == 1;
  const std::vector<Item> items =
      work_items(p, num_seqs, decode != nullptr && num_decodes >= 2 * at::get_num_threads());
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(num_items, 1));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch(kQueryTile * (p.num_heads / p.num_kv_heads), p.head_dim);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item &it = items[i];
      if constexpr (kRegisterDecode<T>) {
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
      run_item<T, kD>(p, it, q, kc, vc, o, scratch);
    }
  });
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
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "block_tables, query_start_loc and context_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous(), "block_tables must be [S, MAXB] contiguous");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "one block table and one context length per sequence");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
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
    const scalar_t *kc = key_cache.data_ptr<scalar_t>();
    const scalar_t *vc = value_cache.data_ptr<scalar_t>();
    scalar_t *o = out.data_ptr<scalar_t>();
    switch (p.head_dim) {
      case 32: return run_all<scalar_t, 32>(p, num_seqs, q, kc, vc, o);
      case 64: return run_all<scalar_t, 64>(p, num_seqs, q, kc, vc, o);
      case 128: return run_all<scalar_t, 128>(p, num_seqs, q, kc, vc, o);
      case 256: return run_all<scalar_t, 256>(p, num_seqs, q, kc, vc, o);
      default: return run_all<scalar_t, 0>(p, num_seqs, q, kc, vc, o);
    }
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

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, float scale, int window, float softcap) -> Tensor");
  m.def("parallel_width() -> int", &parallel_width);
  m.def("register_tiles() -> bool", &register_tiles);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
