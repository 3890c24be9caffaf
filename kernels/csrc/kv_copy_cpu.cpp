// Copy KV blocks and checksum them in one pass: the direct same-host transfer's receiver side.
//
// The checksum is XXH3-64 (seed 0, default secret): the digest of the xxhash library over the same
// bytes, so the sender keeps hashing with the library and the two compare as before. Each 64-byte
// stripe is loaded once, stored to its destination block and folded into the accumulators while
// it is in registers; copying a tile and then hashing it read every byte twice.
//
// Only the long-input path of XXH3 is here (the stream is over 240 bytes and a whole number of
// 64-byte stripes, which every block size the engine makes is): with the stream's length L = 64 S,
// stripes 0 .. S-2 accumulate against the secret at 8 x (stripe mod 16), the accumulators are
// scrambled after every 16th of them, and stripe S-1 is the "last stripe" (secret + 121).
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kPrime32_1 = 0x9E3779B1ULL, kPrime32_2 = 0x85EBCA77ULL, kPrime32_3 = 0xC2B2AE3DULL;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL, kPrime64_2 = 0xC2B2AE3D27D4EB4FULL,
                   kPrime64_3 = 0x165667B19E3779F9ULL, kPrime64_4 = 0x85EBCA77C2B2AE63ULL,
                   kPrime64_5 = 0x27D4EB2F165667C5ULL, kPrimeMx1 = 0x165667919E3779F9ULL;
constexpr int64_t kStripe = 64, kStripesPerBlock = 16, kSecretSize = 192, kMidsizeMax = 240;

// XXH3's default secret (the specification's kSecret).
alignas(64) constexpr uint8_t kSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d,
    0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0,
    0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0,
    0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,
    0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51,
    0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34,
    0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49,
    0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,
    0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b,
    0x40, 0x7e,
};

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "XXH3 reads little-endian words");

inline uint64_t read64(const uint8_t *p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

alignas(64) constexpr uint64_t kInitAcc[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                              kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};

#if defined(__AVX512F__)
// One stripe and the eight accumulators each fit one register.
using Lanes = __m512i;
inline Lanes load_lanes(const void *p) { return _mm512_loadu_si512(p); }
inline void store_lanes(void *p, Lanes v) { _mm512_storeu_si512(p, v); }
// Straight to memory, past the cache: no read-for-ownership of a line about to be overwritten
// whole (which a plain store pays: three memory transfers a line instead of two). 64-byte aligned.
inline void stream_lanes(void *p, Lanes v) { _mm512_stream_si512(static_cast<__m512i *>(p), v); }
inline void stream_fence() { _mm_sfence(); }

// acc[i ^ 1] += data[i]; acc[i] += lo32(data[i] ^ key[i]) * hi32(data[i] ^ key[i])
inline Lanes accumulate(Lanes acc, Lanes data, const uint8_t *key) {
  const Lanes dk = _mm512_xor_si512(data, load_lanes(key));
  const Lanes product = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
  const Lanes swapped = _mm512_shuffle_epi32(data, static_cast<_MM_PERM_ENUM>(0x4E));  // 64-bit pairs swapped
  return _mm512_add_epi64(acc, _mm512_add_epi64(product, swapped));
}

// acc = ((acc ^ acc >> 47) ^ key) * PRIME32_1, the 64-bit product from two 32 x 32 ones
inline Lanes scramble(Lanes acc, const uint8_t *key) {
  const Lanes a = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), load_lanes(key));
  const Lanes prime = _mm512_set1_epi64(kPrime32_1);
  const Lanes high = _mm512_slli_epi64(_mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime), 32);
  return _mm512_add_epi64(_mm512_mul_epu32(a, prime), high);
}
#else
struct Lanes {
  uint64_t w[8];
};
inline Lanes load_lanes(const void *p) {
  Lanes v;
  std::memcpy(v.w, p, sizeof v.w);
  return v;
}
inline void store_lanes(void *p, const Lanes &v) { std::memcpy(p, v.w, sizeof v.w); }
inline void stream_lanes(void *p, const Lanes &v) { store_lanes(p, v); }
inline void stream_fence() {}

inline Lanes accumulate(Lanes acc, const Lanes &data, const uint8_t *key) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t dk = data.w[i] ^ read64(key + 8 * i);
    acc.w[i ^ 1] += data.w[i];
    acc.w[i] += (dk & 0xFFFFFFFFULL) * (dk >> 32);
  }
  return acc;
}

inline Lanes scramble(Lanes acc, const uint8_t *key) {
  for (int i = 0; i < 8; ++i) acc.w[i] = ((acc.w[i] ^ (acc.w[i] >> 47)) ^ read64(key + 8 * i)) * kPrime32_1;
  return acc;
}
#endif

// XXH3's final merge of the accumulators, for a stream of num_stripes stripes.
uint64_t xxh3_digest(Lanes acc, int64_t num_stripes) {
  alignas(64) uint64_t a[8];
  store_lanes(a, acc);
  uint64_t h = static_cast<uint64_t>(num_stripes * kStripe) * kPrime64_1;
  const uint8_t *key = kSecret + 11;
  for (int i = 0; i < 4; ++i) {
    const __uint128_t product =
        static_cast<__uint128_t>(a[2 * i] ^ read64(key + 16 * i)) * (a[2 * i + 1] ^ read64(key + 16 * i + 8));
    h += static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
  }
  h ^= h >> 37;
  h *= kPrimeMx1;
  return h ^ (h >> 32);
}

// Releases the GIL while it lives, where the caller holds it: the receiver copies on its own
// thread while the engine's thread runs Python between steps.
struct WithoutGil {
  PyThreadState *state = nullptr;
  WithoutGil() {
    if (Py_IsInitialized() && PyGILState_Check()) state = PyEval_SaveThread();
  }
  ~WithoutGil() {
    if (state != nullptr) PyEval_RestoreThread(state);
  }
};

// src_k / src_v: [NB_src, block_bytes] uint8; dst_k / dst_v: [NB_dst, block_bytes] uint8, or empty
// for a checksum only. Block src_ids[i] of each goes to dst_ids[i]; the returned XXH3-64 is over
// the K blocks in src_ids order, then the V blocks: shared_cache.layer_checksum's stream.
int64_t copy_blocks_xxh3(const at::Tensor &src_k, const at::Tensor &src_v, const at::Tensor &dst_k,
                         const at::Tensor &dst_v, const at::Tensor &src_ids, const at::Tensor &dst_ids) {
  TORCH_CHECK(src_k.scalar_type() == at::kByte && src_v.scalar_type() == at::kByte && src_k.dim() == 2 &&
                  src_k.sizes() == src_v.sizes() && src_k.is_contiguous() && src_v.is_contiguous(),
              "src_k and src_v must be contiguous [blocks, block_bytes] uint8 of one shape");
  const bool copy = dst_k.numel() > 0;
  const int64_t block_bytes = src_k.size(1), n = src_ids.numel();
  TORCH_CHECK(block_bytes % kStripe == 0, "block_bytes must be a multiple of 64");
  TORCH_CHECK(2 * n * block_bytes > kMidsizeMax, "the stream must be over 240 bytes (XXH3's long path)");
  TORCH_CHECK(src_ids.scalar_type() == at::kLong && src_ids.dim() == 1 && src_ids.is_contiguous(),
              "src_ids must be int64 [n]");
  const int64_t *src_id = src_ids.data_ptr<int64_t>();
  const int64_t *dst_id = nullptr;
  if (copy) {
    TORCH_CHECK(dst_k.scalar_type() == at::kByte && dst_v.scalar_type() == at::kByte && dst_k.dim() == 2 &&
                    dst_k.sizes() == dst_v.sizes() && dst_k.size(1) == block_bytes && dst_k.is_contiguous() &&
                    dst_v.is_contiguous(),
                "dst_k and dst_v must be contiguous [blocks, block_bytes] uint8 like the sources");
    TORCH_CHECK(dst_ids.scalar_type() == at::kLong && dst_ids.numel() == n && dst_ids.is_contiguous(),
                "dst_ids must be int64, one per source block");
    dst_id = dst_ids.data_ptr<int64_t>();
  }
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(src_id[i] >= 0 && src_id[i] < src_k.size(0), "source block ", src_id[i], " outside the cache");
    TORCH_CHECK(!copy || (dst_id[i] >= 0 && dst_id[i] < dst_k.size(0)), "destination block ", dst_id[i],
                " outside the cache");
  }
  // The stream's state lives in locals, so the accumulators stay in a register: held in a struct
  // reached through memory, every stripe paid a store-to-load round trip (4x slower in cache).
  const int64_t num_stripes = 2 * n * block_bytes / kStripe, stripes_per_block = block_bytes / kStripe;
  // No call inside the loops (every vector register is caller-saved), so base pointers first.
  const uint8_t *src_k_data = src_k.data_ptr<uint8_t>(), *src_v_data = src_v.data_ptr<uint8_t>();
  uint8_t *dst_k_data = copy ? dst_k.data_ptr<uint8_t>() : nullptr;
  uint8_t *dst_v_data = copy ? dst_v.data_ptr<uint8_t>() : nullptr;
  Lanes acc = load_lanes(kInitAcc);
  int64_t in_block = 0, done = 0;  // stripes since the last scramble; stripes hashed
  {
    WithoutGil unlocked;
    for (int64_t j = 0; j < 2 * n; ++j) {  // the K blocks, then the V blocks
      const int64_t i = j < n ? j : j - n;
      const uint8_t *from = (j < n ? src_k_data : src_v_data) + src_id[i] * block_bytes;
      uint8_t *to = copy ? (j < n ? dst_k_data : dst_v_data) + dst_id[i] * block_bytes : nullptr;
      const bool stream = to != nullptr && reinterpret_cast<uintptr_t>(to) % kStripe == 0;
      // Every stripe but the stream's very last accumulates in place; that one takes the last key.
      const int64_t body = done + stripes_per_block == num_stripes ? stripes_per_block - 1 : stripes_per_block;
      for (int64_t b = 0; b < body; ++b) {
        const Lanes stripe = load_lanes(from + b * kStripe);  // read once: stored, then hashed
        if (stream) stream_lanes(to + b * kStripe, stripe);
        else if (to != nullptr) store_lanes(to + b * kStripe, stripe);
        acc = accumulate(acc, stripe, kSecret + 8 * in_block);
        if (++in_block == kStripesPerBlock) {
          acc = scramble(acc, kSecret + kSecretSize - kStripe);
          in_block = 0;
        }
      }
      done += body;
      if (body < stripes_per_block) {  // the last stripe
        const Lanes stripe = load_lanes(from + body * kStripe);
        if (stream) stream_lanes(to + body * kStripe, stripe);
        else if (to != nullptr) store_lanes(to + body * kStripe, stripe);
        acc = accumulate(acc, stripe, kSecret + kSecretSize - kStripe - 7);
      }
    }
  }
  stream_fence();  // the streamed stores are visible before the caller reads the blocks
  return static_cast<int64_t>(xxh3_digest(acc, num_stripes));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("copy_blocks_xxh3(Tensor src_k, Tensor src_v, Tensor(a!) dst_k, Tensor(b!) dst_v, Tensor src_ids, "
        "Tensor dst_ids) -> int");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("copy_blocks_xxh3", &copy_blocks_xxh3); }
