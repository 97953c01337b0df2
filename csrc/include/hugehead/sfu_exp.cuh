// The SFU's exponentials (and its log2) for float32 (no torch headers: the CUTLASS GEMMs' translation units include it too).
#pragma once

#include <cuda_runtime.h>

namespace hugehead {
namespace cuda {

// exp(x) as __expf computes it (ex2.approx of x log2(e)) except that results below 2^-126 flush to zero: one
// MUFU.EX2 instead of the five instructions of the denormal-preserving ex2.approx.f32. A flushed term is below
// 1.2e-38: it changes no sum that holds the row max's exp(0) = 1, and no gradient entry by more than bf16's
// smallest normal.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * kLog2e); }

// exp(z - m) as exp_ftz, given m_log2e = m log2(e): one FFMA (z log2(e) - m log2(e)) and one MUFU.EX2; -inf and
// NaN logits give 0 and NaN as exp(z - m) does. The exponent carries m log2(e)'s rounding (up to ~4e-8 |m|):
// exp(0) comes out as 1 + ~1e-7, far below 16-bit logits' resolution (the fused GEMMs, chunk_grad_'s 16-bit
// path) but not below float32's, so float32 logits take exp2_ftz((z - m) log2(e)) (fold_values).
__device__ __forceinline__ float exp_minus(float z, float m_log2e) { return exp2_ftz(::fmaf(z, kLog2e, -m_log2e)); }

// log2(x) as __log2f computes it: MUFU.LG2 (absolute error ~2^-22) with the denormal inputs scaled first, in ~4
// instructions where log2f's polynomial takes ~35. For per-row offsets folded into an exponent (the fused
// gradient's log2(g)): 2^-22 in an exponent is a relative 3e-7, far below a 16-bit gradient's resolution.
__device__ __forceinline__ float log2_sfu(float x) {
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace cuda
}  // namespace hugehead
