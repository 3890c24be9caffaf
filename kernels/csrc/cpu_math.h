// Shared arithmetic of the CPU kernels (paged_attention_cpu.cpp, dense_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pdserve {

// exp(x) for the softmax in plain arithmetic, so that loops of it vectorise (std::exp does not
// without -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
// (relative error < 1e-8, under fp32 rounding), times 2^n built in the exponent bits.
// Below -87 (and for -inf, the masked scores) the result is exactly 0.
inline float softmax_exp(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: exact n * hi
  float e = 1.f / 5040.f;
  e = e * r + 1.f / 720.f;
  e = e * r + 1.f / 120.f;
  e = e * r + 1.f / 24.f;
  e = e * r + 1.f / 6.f;
  e = e * r + 0.5f;
  e = e * r + 1.f;
  e = e * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(x < -87.f ? 0.f : n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : e * scale;
}

// silu(x) = x * sigmoid(x) with softmax_exp of -|x| (never above 0, so it cannot overflow):
// sigmoid(x) = 1 / (1 + e) for x >= 0 and e / (1 + e) below, e = exp(-|x|). Vectorises.
inline float silu(float x) {
  const float e = softmax_exp(-std::fabs(x));
  return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

}  // namespace pdserve
