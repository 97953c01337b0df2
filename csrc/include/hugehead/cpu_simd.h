// Vectorizable float32 row loops for the CPU kernels (no softcap): the compiler turns them into SIMD
// code (OpenMP simd reductions, an exp made of arithmetic and bit operations; built with
// -fopenmp-simd -fno-trapping-math, without which the float-to-int step of the exp blocks if-conversion),
// and on x86-64 GCC/Clang build an AVX2 clone chosen at load time beside the baseline one. Results are deterministic for a
// given machine (a fixed reduction order per clone).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define HUGEHEAD_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef HUGEHEAD_CPU_CLONES
#define HUGEHEAD_CPU_CLONES
#endif

namespace hugehead {
namespace cpu {

// exp(x) for x <= 0 (and NaN), within ~2 ulp of std::exp: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial for exp(r) (Cephes' expf), 2^n through the exponent bits. Below -87.3 (where float's
// normal range ends) it returns 0, so exp(-inf) is 0 as the online log-sum-exp needs; NaN stays NaN.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.3f);  // keeps 2^n a normal number; NaN passes through (first argument)
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale * static_cast<float>(!(x < -87.3f));  // a multiply, not a branch: stays vectorized
}

// A float32 row's max (NaN-ignoring) and whether it holds a NaN.
HUGEHEAD_CPU_CLONES
inline float row_max_f32(const float* z, int64_t cols, bool& has_nan_out) {
  float m = -std::numeric_limits<float>::infinity();
  int has_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : has_nan)
  for (int64_t j = 0; j < cols; ++j) {
    m = z[j] > m ? z[j] : m;
    has_nan |= (z[j] != z[j]);
  }
  has_nan_out = has_nan != 0;
  return m;
}

// One row of chunk_stats_ in float32 without softcap: (max, sum of exp(z - max), sum of z), NaN-aware:
// a NaN anywhere makes the sum NaN (the max may then be anything), as the generic kernel does.
HUGEHEAD_CPU_CLONES
inline void row_stats_f32(const float* z, int64_t cols, float& max_out, float& sumexp_out, float& sum_out) {
  bool has_nan;
  const float m = row_max_f32(z, cols, has_nan);
  float s = 0.0f, sum = 0.0f;
  if (m == -std::numeric_limits<float>::infinity()) {  // every logit -inf: exp(-inf - -inf) counts as 0
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < cols; ++j) sum += z[j];
  } else {
#pragma omp simd reduction(+ : s, sum)
    for (int64_t j = 0; j < cols; ++j) {
      s += exp_nonpositive(z[j] - m);
      sum += z[j];
    }
  }
  max_out = m;
  sumexp_out = has_nan ? std::numeric_limits<float>::quiet_NaN() : s;
  sum_out = sum;
}

// One row of chunk_grad_ in float32 without softcap, in place:
//   z_j <- g (p_j - smooth - tw [j == t] + p_j z_term) + g_lse p_j,  p_j = exp(z_j - lse)
// (the generic kernel's formula, rounding aside).
HUGEHEAD_CPU_CLONES
inline void row_grad_f32(float* z, int64_t cols, int64_t t, float lse, float g, float g_lse, float z_term,
                         float smooth, float tw) {
  // As logit_grad: the one-hot term is subtracted before the z-loss term is added, so a small z-loss
  // gradient on a confident target (p ~ 1) is not lost to rounding.
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    const float prob = exp_nonpositive(z[j] - lse);
    const float d = ((prob - smooth) - tw * static_cast<float>(j == t)) + prob * z_term;
    z[j] = g * d + g_lse * prob;
  }
}

// One row of entropy_chunk_stats_ in float32 without softcap: (max, sum of exp(z - max), sum of
// exp(z - max) (z - max)), NaN-aware as row_stats_f32. A -inf logit's (z - max) is clamped to the lowest float
// so that its 0 * (z - max) term is 0, not NaN.
HUGEHEAD_CPU_CLONES
inline void row_entropy_stats_f32(const float* z, int64_t cols, float& max_out, float& sumexp_out,
                                  float& shifted_out) {
  bool has_nan;
  const float m = row_max_f32(z, cols, has_nan);
  float s = 0.0f, a = 0.0f;
  if (m != -std::numeric_limits<float>::infinity()) {
    const float lowest = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(+ : s, a)
    for (int64_t j = 0; j < cols; ++j) {
      const float d = std::max(z[j] - m, lowest);
      const float e = exp_nonpositive(d);
      s += e;
      a += e * d;
    }
  }
  max_out = m;
  sumexp_out = has_nan ? std::numeric_limits<float>::quiet_NaN() : s;
  shifted_out = has_nan ? std::numeric_limits<float>::quiet_NaN() : a;
}

// One row of entropy_chunk_grad_ in float32 without softcap, in place:
//   z_j <- g (p_j - [j == t]) - g_entropy p_j (log p_j + entropy),  log p_j = z_j - lse
HUGEHEAD_CPU_CLONES
inline void row_entropy_grad_f32(float* z, int64_t cols, int64_t t, float lse, float g, float g_entropy,
                                 float entropy) {
  const float lowest = std::numeric_limits<float>::lowest();
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    const float lp = std::max(z[j] - lse, lowest);
    const float prob = exp_nonpositive(lp);
    z[j] = g * (prob - static_cast<float>(j == t)) - g_entropy * prob * (lp + entropy);
  }
}

}  // namespace cpu
}  // namespace hugehead
