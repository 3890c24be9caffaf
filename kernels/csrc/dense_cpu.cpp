// The per-layer elementwise work of a decoder layer on CPU, one pass over memory each, in torch's
// own thread pool (at::parallel_for over token rows). Unfused, each is 3-7 torch ops that each read
// and write the whole activation; on the 30-layer default model they were a sixth of a prefill step.
//
//   rms_norm(x, w, eps, unit_offset)    Llama: w * dtype(x / rms(x));  Gemma: dtype(x / rms(x) * (1 + w))
//   add_rms_norm_(x, residual, w, ...)  residual += x (rounded to dtype, as torch's add), then rms_norm
//                                       of the sum: the pre-norm layer's "x + attn; norm(x)" in one pass
//   silu_mul(gate_up)                   [T, 2I] -> [T, I]: silu(gate) * up, gate the first I columns
//   rotary_(x, positions, cos, sin)     in place on [T, heads, D]: x * cos + rotate_half(x) * sin,
//                                       HF's rotate-half convention, cos/sin rows picked by position
//   argmax_rows(x)                      [rows, n] fp32 -> [rows] int64: torch.argmax(x, -1), the first
//                                       maximum, a NaN counting as the maximum; the greedy sampler's
//   write_kv_int8_(k, v, kc, vc, slots) new tokens' K/V [T, KVH, D] into int8 caches (nbhd-q8-v1):
//                                       each row quantized alone, as kernels/kv_int8.quantize_rows
//   quantize_rows_u8(x)                 [T, K] -> (uint8 [T, K], fp32 [T, 1]): each row's symmetric
//                                       int8 (scale max|x| / 127) plus 128, as kernels/cpu_int8's
//                                       torch path; the W8A8 linear layers' activations
//   dequantize_rows(acc, scale, bias, dtype)  [T, N] fp32 * scale[T] (+ bias[N]), rounded to dtype
//
// Arithmetic is fp32 whatever the dtype, rounded where the torch expression it replaces rounds.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

// Rows per parallel chunk: at least kParallelElems elements, so that a decode step's few rows run
// on the calling thread; waking a sleeping pool thread (OMP_WAIT_POLICY=PASSIVE) costs tens of us.
constexpr int64_t kParallelElems = 1 << 15;
inline int64_t row_grain(int64_t elems_per_row) {
  return std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, elems_per_row));
}

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

template <typename T>
void rms_norm_rows(const T *x, const T *w, T *out, int64_t rows, int64_t dim, int64_t stride, float eps,
                   bool unit_offset) {
  at::parallel_for(0, rows, row_grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T *xr = x + r * stride;
      T *o = out + r * dim;
      float ss = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      if (unit_offset) {
        for (int64_t i = 0; i < dim; ++i)
          o[i] = round_to<T>(static_cast<float>(xr[i]) * inv * (1.f + static_cast<float>(w[i])));
      } else {
        for (int64_t i = 0; i < dim; ++i)
          o[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(static_cast<float>(xr[i]) * inv)));
      }
    }
  });
}

void check_norm_args(const at::Tensor &x, const at::Tensor &weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, dim] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be [dim] contiguous");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share one dtype");
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps, bool unit_offset) {
  check_norm_args(x, weight);
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_cpu", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), x.stride(0), static_cast<float>(eps), unit_offset);
  });
  return out;
}

at::Tensor add_rms_norm_(const at::Tensor &x, at::Tensor &residual, const at::Tensor &weight, double eps,
                         bool unit_offset) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must be contiguous, of x's shape and dtype");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_cpu", [&] {
    scalar_t *res = residual.data_ptr<scalar_t>();
    const scalar_t *xs = x.data_ptr<scalar_t>();
    const scalar_t *w = weight.data_ptr<scalar_t>();
    scalar_t *o = out.data_ptr<scalar_t>();
    const int64_t dim = x.size(1), stride = x.stride(0);
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, x.size(0), row_grain(2 * dim), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        scalar_t *rr = res + r * dim;
        const scalar_t *xr = xs + r * stride;
        for (int64_t i = 0; i < dim; ++i)
          rr[i] = round_to<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      }
      rms_norm_rows<scalar_t>(res + r0 * dim, w, o + r0 * dim, r1 - r0, dim, dim, feps, unit_offset);
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor &gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * I] with contiguous rows");
  const int64_t n = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul_cpu", [&] {
    const scalar_t *in = gate_up.data_ptr<scalar_t>();
    scalar_t *o = out.data_ptr<scalar_t>();
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, gate_up.size(0), row_grain(3 * n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *g = in + r * stride, *u = g + n;
        scalar_t *orow = o + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const float gv = static_cast<float>(g[i]);
          // torch rounds silu's result to the dtype before the product; so do we
          const float act = static_cast<float>(round_to<scalar_t>(pdserve::silu(gv)));
          orow[i] = round_to<scalar_t>(act * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

void rotary_(at::Tensor &x, const at::Tensor &positions, const at::Tensor &cos, const at::Tensor &sin) {
  // x: [T, heads, D] (rows may be strided, heads and D contiguous); cos, sin: [P, D] fp32 contiguous
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, heads, D], heads packed");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == x.size(2) && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos and sin must be [positions, D] fp32 contiguous");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0) && positions.scalar_type() == at::kLong,
              "positions must be [T] int64");
  TORCH_CHECK(x.size(2) % 2 == 0, "head_dim must be even");
  auto pos = positions.contiguous();
  const int64_t *p = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "position ", p[t], " outside the rotary table");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_cpu", [&] {
    scalar_t *base = x.data_ptr<scalar_t>();
    const float *cs = cos.data_ptr<float>(), *sn = sin.data_ptr<float>();
    const int64_t heads = x.size(1), d = x.size(2), half = d / 2, stride = x.stride(0);
    at::parallel_for(0, x.size(0), row_grain(heads * d), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        // HF rounds cos and sin to the dtype first, then computes x*cos + rotate_half(x)*sin in it
        const float *c = cs + p[t] * d, *s = sn + p[t] * d;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t *v = base + t * stride + h * d;
          for (int64_t i = 0; i < half; ++i) {
            const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
            const float c0 = static_cast<float>(round_to<scalar_t>(c[i]));
            const float s0 = static_cast<float>(round_to<scalar_t>(s[i]));
            const float c1 = static_cast<float>(round_to<scalar_t>(c[i + half]));
            const float s1 = static_cast<float>(round_to<scalar_t>(s[i + half]));
            const float lo = static_cast<float>(round_to<scalar_t>(a * c0)) +
                             static_cast<float>(round_to<scalar_t>(-b * s0));
            const float hi = static_cast<float>(round_to<scalar_t>(b * c1)) +
                             static_cast<float>(round_to<scalar_t>(a * s1));
            v[i] = round_to<scalar_t>(lo);
            v[i + half] = round_to<scalar_t>(hi);
          }
        }
      }
    });
  });
}

// First index of the row's maximum, as torch.argmax: per lane the first strict maximum of its
// column of 16, then the lanes' best value, the smallest index among equals. A NaN wins (torch's
// rule): a row with one is scanned again for its first NaN.
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

int64_t argmax_row(const float *x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = -INFINITY;
  bool nan = false;
  if (n >= 16) {
    vf16 vmax, v;
    std::memcpy(&vmax, x, sizeof vmax);
    vi16 vidx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, cur = vidx, vnan = vmax != vmax;
    for (i = 16; i + 16 <= n; i += 16) {
      cur += 16;
      std::memcpy(&v, x + i, sizeof v);
      const vi16 gt = v > vmax;
      vmax = gt ? v : vmax;
      vidx = gt ? cur : vidx;
      vnan |= v != v;
    }
    best_value = vmax[0];
    best = vidx[0];
    for (int l = 0; l < 16; ++l) {
      nan |= vnan[l] != 0;
      if (vmax[l] > best_value || (vmax[l] == best_value && vidx[l] < best)) {
        best_value = vmax[l];
        best = vidx[l];
      }
    }
  }
  for (; i < n; ++i) {  // the tail (or a row under 16): later indices, so only a strict maximum wins
    nan |= x[i] != x[i];
    if (x[i] > best_value || (i == 0 && n < 16)) {
      best_value = x[i];
      best = i;
    }
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor &x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be [rows, n] fp32 with n > 0 and unit column stride");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float *base = x.data_ptr<float>();
  int64_t *o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), row_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

// One (token, head) row into its int8 slot: scale = max|x| / 127, q = round-half-even(x / scale)
// clamped to +-127, then the scale's bytes; all-zero rows get q = 0, scale 0. The same fp32
// operations as kernels/kv_int8.quantize_rows, so both write the same bytes.
template <typename T>
void quantize_row(const T *x, int8_t *dst, int64_t d) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = amax / 127.f;
  for (int64_t i = 0; i < d; ++i) {
    const float q = amax > 0.f ? std::nearbyint(static_cast<float>(x[i]) / scale) : 0.f;
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(dst + d, &scale, sizeof scale);
}

void write_kv_int8_(const at::Tensor &key, const at::Tensor &value, at::Tensor &key_cache, at::Tensor &value_cache,
                    const at::Tensor &slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.scalar_type() == value.scalar_type(),
              "key and value must be [T, KVH, D] of one dtype");
  TORCH_CHECK(key_cache.scalar_type() == at::kChar && value_cache.scalar_type() == at::kChar &&
                  key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "caches must be contiguous int8 [num_blocks, block_size, KVH, D + 4] of one shape");
  const int64_t tokens = key.size(0), heads = key.size(1), d = key.size(2);
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(2) == heads && key_cache.size(3) == d + 4,
              "cache rows must be head_dim + 4 bytes, one per KV head");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens, "one slot per token");
  auto k = key.contiguous(), v = value.contiguous();
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t *slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1), row = d + 4;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "slot ", slot[t], " outside the cache");
  int8_t *kc = key_cache.data_ptr<int8_t>(), *vc = value_cache.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_int8_", [&] {
    const scalar_t *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, row_grain(2 * heads * d), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (slot[t] < 0) continue;  // a padded row: written nowhere
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t src = (t * heads + h) * d, dst = (slot[t] * heads + h) * row;
          quantize_row(kp + src, kc + dst, d);
          quantize_row(vp + src, vc + dst, d);
        }
      }
    });
  });
}

// A W8A8 linear layer's activations (kernels/cpu_int8.py): row t's scale = max|x_t| / 127 and
// q = round-half-even(x / scale) clamped to +-127, stored plus 128 as uint8 (oneDNN's int8 matmul
// takes unsigned activations with a zero point: VNNI multiplies u8 by s8). An all-zero row: q = 0
// (stored 128), scale 0. The same fp32 operations as the torch path, so both give the same bytes.

// One row into uint8 (see quantize_rows_u8). Two plain loops over fp32 that the compiler
// vectorizes (max of |x|; divide, round, clamp, narrow); ``tmp`` holds the row in fp32.
inline float quantize_row_u8(const float *x, uint8_t *o, int64_t k) {
  // max |x| as the largest of the values' bits with the sign cleared: for floats that are not NaN
  // the bits order as the values do, and an integer max reduction vectorizes (a float one does
  // not, for NaN's sake). A NaN's bits exceed infinity's, so a NaN row still gives a NaN scale.
  uint32_t bits = 0;
  for (int64_t i = 0; i < k; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof b);
    bits = std::max(bits, b & 0x7fffffffu);
  }
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  const float scale = amax / 127.f;
  if (amax == 0.f) {
    std::memset(o, 128, static_cast<size_t>(k));
    return scale;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / scale)));
    o[i] = static_cast<uint8_t>(static_cast<int32_t>(v) + 128);
  }
  return scale;
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor &x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, K] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0);
  auto q = at::empty({rows, k}, x.options().dtype(at::kByte));
  auto scales = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  uint8_t *qp = q.data_ptr<uint8_t>();
  float *sp = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_u8", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(2 * k), [&](int64_t r0, int64_t r1) {
      std::vector<float> tmp(std::is_same_v<scalar_t, float> ? 0 : k);
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *xr = xp + r * stride;
        const float *row;
        if constexpr (std::is_same_v<scalar_t, float>) {
          row = reinterpret_cast<const float *>(xr);  // the same type: the branch is only kept for float
        } else {
          for (int64_t i = 0; i < k; ++i) tmp[i] = static_cast<float>(xr[i]);
          row = tmp.data();
        }
        sp[r] = quantize_row_u8(row, qp + r * k, k);
      }
    });
  });
  return {q, scales};
}

// y[t, n] = acc[t, n] * scale[t] (+ bias[n]) in fp32, rounded once to ``dtype``: the W8A8 matmul's
// int32 sums (already times the weight's per-channel scales, in fp32) back in the model's dtype.
template <typename T, typename B>
void dequantize_rows_impl(const float *acc, const float *scale, const B *bias, T *out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float s = scale[r];
      const float *a = acc + r * n;
      T *o = out + r * n;
      if (bias == nullptr) {
        for (int64_t i = 0; i < n; ++i) o[i] = round_to<T>(a[i] * s);
      } else {
        for (int64_t i = 0; i < n; ++i) o[i] = round_to<T>(a[i] * s + static_cast<float>(bias[i]));
      }
    }
  });
}

at::Tensor dequantize_rows(const at::Tensor &acc, const at::Tensor &scale, const c10::optional<at::Tensor> &bias,
                           at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kFloat, "acc must be [rows, N] fp32");
  TORCH_CHECK(scale.numel() == acc.size(0) && scale.is_contiguous() && scale.scalar_type() == at::kFloat,
              "scale must be [rows] or [rows, 1] fp32");
  const int64_t rows = acc.size(0), n = acc.size(1);
  auto out = at::empty({rows, n}, acc.options().dtype(dtype));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == n, "bias must be [N]");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_rows", [&] {
    using out_t = scalar_t;
    if (!b.defined()) {
      dequantize_rows_impl<out_t, float>(acc.data_ptr<float>(), scale.data_ptr<float>(), nullptr,
                                         out.data_ptr<out_t>(), rows, n);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, b.scalar_type(), "dequantize_rows_bias", [&] {
      dequantize_rows_impl<out_t, scalar_t>(acc.data_ptr<float>(), scale.data_ptr<float>(), b.data_ptr<scalar_t>(),
                                            out.data_ptr<out_t>(), rows, n);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("add_rms_norm_(Tensor x, Tensor(a!) residual, Tensor weight, float eps, bool unit_offset) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("write_kv_int8_(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slots) -> ()");
  m.def("quantize_rows_u8(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantize_rows(Tensor acc, Tensor scale, Tensor? bias, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary_", &rotary_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("write_kv_int8_", &write_kv_int8_);
  m.impl("quantize_rows_u8", &quantize_rows_u8);
  m.impl("dequantize_rows", &dequantize_rows);
}
