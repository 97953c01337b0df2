// Device helpers for the CUDA kernels: block reductions of online log-sum-exp state and the per-row
// vectorized sweep (16-byte loads where the row's address allows, scalar head and tail).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "hugehead/numerics.h"
#include "hugehead/sfu_exp.cuh"

namespace hugehead {
namespace cuda {

constexpr int kWarp = 32;

template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
struct Vec1 {
  static constexpr int kSize = 1;
  T v[1];
};

// f(j0, pack) when f takes the pack's first column, else f(pack).
template <typename F, typename Pack>
__device__ __forceinline__ void call_pack(F& f, int64_t j0, Pack& pack) {
  if constexpr (std::is_invocable_v<F&, int64_t, Pack&>) {
    f(j0, pack);
  } else {
    f(pack);
  }
}

// Calls f(pack) for the row's elements in packs spread over the block's threads: Vec16 packs (16-byte
// loads and stores) for the aligned body, each thread holding kUnroll of them in flight before calling
// f on them in order, and Vec1 packs for the scalar head and tail. f takes the pack by reference and
// may modify it (written back when Write is true); it reads pack.v[0 .. kSize). Which thread sees which
// pack, and in what order, is fixed by (row address, cols, blockDim): deterministic. An f taking
// (int64_t j0, pack&) also gets the column of the pack's first element.
template <typename scalar_t, bool Write, int kUnroll = 2, typename F>
__device__ __forceinline__ void for_each_pack_in_row(scalar_t* row, int64_t cols, F&& f) {
  constexpr int V = Vec16<scalar_t>::kSize;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(scalar_t));
  if ((addr % sizeof(scalar_t)) != 0) head = cols;  // misaligned element pointer: all scalar
  head = head < cols ? head : cols;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) {
    Vec1<scalar_t> one{{row[j]}};
    call_pack(f, j, one);
    if (Write) row[j] = one.v[0];
  }
  const int64_t body = (cols - head) / V;
  auto* vrow = reinterpret_cast<Vec16<scalar_t>*>(row + head);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnroll;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * static_cast<int64_t>(blockDim.x) < body; i += step) {
    Vec16<scalar_t> packs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) packs[u] = vrow[i + u * static_cast<int64_t>(blockDim.x)];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      call_pack(f, head + (i + u * static_cast<int64_t>(blockDim.x)) * V, packs[u]);
      if (Write) vrow[i + u * static_cast<int64_t>(blockDim.x)] = packs[u];
    }
  }
  for (; i < body; i += blockDim.x) {
    Vec16<scalar_t> pack = vrow[i];
    call_pack(f, head + i * V, pack);
    if (Write) vrow[i] = pack;
  }
  for (int64_t j = head + body * V + threadIdx.x; j < cols; j += blockDim.x) {
    Vec1<scalar_t> one{{row[j]}};
    call_pack(f, j, one);
    if (Write) row[j] = one.v[0];
  }
}

// Writes exact zeros over one row, whatever it holds (a row without gradient).
template <typename scalar_t>
__device__ __forceinline__ void zero_row(scalar_t* row, int64_t cols) {
  for_each_pack_in_row<scalar_t, /*Write=*/true>(row, cols, [](auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
    for (int k = 0; k < N; ++k) pack.v[k] = scalar_t(0);
  });
}

// Reduce (max, sumexp, sum) over the warp; the result is valid in lane 0. Fixed tree: deterministic.
template <typename acc_t>
__device__ __forceinline__ void warp_reduce_lse(acc_t& m, acc_t& s, acc_t& sum) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const acc_t m2 = __shfl_down_sync(0xffffffffu, m, off);
    const acc_t s2 = __shfl_down_sync(0xffffffffu, s, off);
    sum += __shfl_down_sync(0xffffffffu, sum, off);
    lse_merge(m, s, m2, s2);
  }
}

// Reduce (max, sumexp, sum) over the block; the result is valid in thread 0. Fixed tree: deterministic.
template <typename acc_t>
__device__ __forceinline__ void block_reduce_lse(acc_t& m, acc_t& s, acc_t& sum) {
  __shared__ acc_t sm[kWarp], ss[kWarp], ssum[kWarp];
  warp_reduce_lse(m, s, sum);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
    ssum[warp] = sum;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < warps ? sm[lane] : neg_inf<acc_t>();
    s = lane < warps ? ss[lane] : acc_t(0);
    sum = lane < warps ? ssum[lane] : acc_t(0);
    warp_reduce_lse(m, s, sum);
  }
}

// Reduce a per-thread triple (m, s, a) over a block of kThreads with merge(m, s, a, m2, s2, a2) (entropy_merge,
// scaled_merge); the result is valid in thread 0. A fixed tree in shared memory: deterministic. Any number of
// calls per kernel, from every thread of the block.
template <int kThreads, typename acc_t, typename Merge>
__device__ __forceinline__ void block_reduce_triple(acc_t& m, acc_t& s, acc_t& a, Merge merge) {
  __shared__ acc_t sm[kThreads], ss[kThreads], sa[kThreads];
  __syncthreads();  // a reduction before this one (the same buffers) may still be read
  sm[threadIdx.x] = m;
  ss[threadIdx.x] = s;
  sa[threadIdx.x] = a;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) merge(sm[threadIdx.x], ss[threadIdx.x], sa[threadIdx.x], sm[threadIdx.x + half],
                                  ss[threadIdx.x + half], sa[threadIdx.x + half]);
    __syncthreads();
  }
  m = sm[0];
  s = ss[0];
  a = sa[0];
}

// Sum over the block; the result is valid in thread 0. Fixed tree: deterministic. Call it at most once
// per kernel (its shared buffer is not guarded for reuse) from every thread of the block.
template <typename acc_t>
__device__ __forceinline__ acc_t block_sum(acc_t v) {
  __shared__ acc_t part[kWarp];
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? part[lane] : acc_t(0);
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  return v;
}

}  // namespace cuda
}  // namespace hugehead

namespace hugehead {
namespace cuda {

// exp for the hot loops: the hardware approximation in float32 (a few ulp, far below bf16/fp32 loss
// tolerances), the exact one in float64.
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
__device__ __forceinline__ double fast_exp(double x) { return ::exp(x); }

// Fold N values into the thread's online (max, sumexp, sum): the pack's max first, so the running sum is
// rescaled at most once per pack and each element costs one exp. NaN reaches the sum through exp (or,
// while the max is still -inf, directly); -inf counts as exp(-inf) = 0; a +inf max makes exp(inf - inf)
// a NaN, as F.cross_entropy's log_softmax does.
template <int N, typename acc_t>
__device__ __forceinline__ void fold_values(const acc_t (&v)[N], acc_t& m, acc_t& s, acc_t& sum) {
  acc_t pm = v[0];
#pragma unroll
  for (int k = 1; k < N; ++k) pm = ::fmax(pm, v[k]);  // NaN-ignoring: NaN is caught below
  if (pm > m) {
    // s * 0 (not a literal 0) when m is still -inf: a NaN already in s must survive.
    s *= m == neg_inf<acc_t>() ? acc_t(0) : cuda::fast_exp(m - pm);
    m = pm;
  }
  if (m == neg_inf<acc_t>()) {  // every value so far is -inf or NaN
#pragma unroll
    for (int k = 0; k < N; ++k) s += v[k] != v[k] ? v[k] : acc_t(0);
  } else if constexpr (std::is_same_v<acc_t, float>) {
    // exp(v - m) as (v - m) log2(e) into one MUFU.EX2 (exp2_ftz) instead of __expf's denormal-preserving ex2
    // (six instructions). The difference first, not exp_minus's FFMA against m log2(e) rounded: for float32
    // logits that rounding (~3e-8 |m|) puts the max's own term at 1 + 1e-7 and a one-class loss visibly off its
    // float64 value; v - m is exact near the max, so the max's term is exactly 1.
#pragma unroll
    for (int k = 0; k < N; ++k) s += exp2_ftz((v[k] - m) * kLog2e);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) s += cuda::fast_exp(v[k] - m);
  }
#pragma unroll
  for (int k = 0; k < N; ++k) sum += v[k];
}

}  // namespace cuda
}  // namespace hugehead
