// CUDA kernel of hugehead::chunk_topk_: one block per row folds a logits chunk into the row's running
// top-k, reading the chunk once in the common case.
//
// Chunks come in ascending class order, so a value of this chunk equal to the running k-th loses the tie:
// only keys strictly above the k-th's (topk.h) can enter. While reading the row (16-byte loads) each
// thread tests its values against that bar; the few that pass are gathered into shared memory
// (warp-aggregated slots), sorted there (bitonic) and merged with the running top-k by rank (binary
// searches), rewriting only the positions that change. After the first chunks almost no value passes.
// When more pass than the buffer holds (the first chunk, a row whose logits rise with the class id) the
// chunk's own exact top k is taken instead: a radix select over the keys finds the k-th key, then one
// ordered pass gathers the keys above it and the lowest-column ties at it. Deterministic: the result is
// fixed by the total order, whatever the order of the atomics.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "hugehead/common.h"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"
#include "hugehead/topk.h"

namespace hugehead {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / cuda::kWarp;
constexpr int kUnroll = 2;
constexpr unsigned kFull = 0xffffffffu;
// Largest k of this kernel: its shared memory holds 2k candidates and the k running keys and values.
constexpr int64_t kMaxK = 4096;

// Candidate slots of a row: at least 2k (so the exact fallback's k fit, with room to spare for a chunk
// that only partly passes the bar), a power of two (the bitonic sort) and at least 1024.
int64_t candidate_capacity(int64_t k) {
  int64_t cap = 1024;
  while (cap < 2 * k) cap *= 2;
  return cap;
}

int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

// Dynamic shared memory of one block, in this order (each piece keeps the next one aligned):
// out_id [k8] int64, cand_key [cap] key_t, run_key [k8] key_t, cand_col [cap] int32, out_val [k8] scalar_t.
template <typename scalar_t>
size_t shared_bytes(int64_t k, int64_t cap) {
  const int64_t k8 = round_up8(k);
  return k8 * sizeof(int64_t) + cap * sizeof(topk_key_t<scalar_t>) + k8 * sizeof(topk_key_t<scalar_t>) +
         cap * sizeof(int32_t) + k8 * sizeof(scalar_t);
}

// Block-uniform sweep of a row in column order: every thread calls f(vals, col0, n) the same number of
// times, with vals[0 .. n) its next elements at columns col0 .. col0 + n - 1 (n = 0 past the end). Within
// one round of calls a thread's columns come before those of the next thread, and rounds go left to
// right, so f may use warp and block collectives and rank elements by column. 16-byte loads for the
// aligned body (kUnrollT of them in flight per thread), single elements for the head and tail.
template <typename scalar_t, int kUnrollT, typename F>
__device__ __forceinline__ void sweep_row(const scalar_t* row, int64_t cols, F&& f) {
  constexpr int V = cuda::Vec16<scalar_t>::kSize;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(scalar_t));
  if ((addr % sizeof(scalar_t)) != 0) head = cols;  // misaligned element pointer: all single elements
  head = head < cols ? head : cols;
  const int64_t body = (cols - head) / V;
  const int64_t tail = head + body * V;
  auto singles = [&](int64_t begin, int64_t end) {
    for (int64_t j0 = begin; j0 < end; j0 += blockDim.x) {
      const int64_t j = j0 + threadIdx.x;
      scalar_t one[V] = {};
      const int n = j < end ? 1 : 0;
      if (n) one[0] = row[j];
      f(static_cast<const scalar_t*>(one), j, n);
    }
  };
  singles(0, head);
  const auto* vrow = reinterpret_cast<const cuda::Vec16<scalar_t>*>(row + head);
  const int64_t step = static_cast<int64_t>(blockDim.x) * kUnrollT;
  for (int64_t i0 = 0; i0 < body; i0 += step) {
    cuda::Vec16<scalar_t> packs[kUnrollT] = {};
#pragma unroll
    for (int u = 0; u < kUnrollT; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < body) packs[u] = vrow[i];
    }
#pragma unroll
    for (int u = 0; u < kUnrollT; ++u) {
      const int64_t i = i0 + u * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      f(static_cast<const scalar_t*>(packs[u].v), head + i * V, i < body ? V : 0);
    }
  }
  singles(tail, cols);
}

// Inclusive prefix sum over the warp's lanes.
__device__ __forceinline__ int warp_inclusive_sum(int x) {
  const int lane = threadIdx.x % cuda::kWarp;
#pragma unroll
  for (int off = 1; off < cuda::kWarp; off *= 2) {
    const int y = __shfl_up_sync(kFull, x, off);
    if (lane >= off) x += y;
  }
  return x;
}

// Warp-aggregated slots: each lane asks for `count`; returns the lane's first slot of `counter`.
__device__ __forceinline__ int warp_claim(int count, int* counter) {
  const int incl = warp_inclusive_sum(count);
  int base = 0;
  if (threadIdx.x % cuda::kWarp == cuda::kWarp - 1) base = atomicAdd(counter, incl);
  return __shfl_sync(kFull, base, cuda::kWarp - 1) + incl - count;
}

// Number of leading entries of a non-increasing array a[0 .. n) that are >= x (Strict: > x).
template <bool Strict, typename key_t>
__device__ __forceinline__ int count_leading(const key_t* a, int n, key_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (Strict ? a[mid] > x : a[mid] >= x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename scalar_t, typename acc_t, bool kSoftcap>
__global__ void __launch_bounds__(kThreads) chunk_topk_kernel(ChunkTopkParams p, int cap) {
  using key_t = topk_key_t<scalar_t>;
  constexpr int V = cuda::Vec16<scalar_t>::kSize;
  constexpr key_t kNaN = static_cast<key_t>(~key_t(0));
  constexpr int kKeyBits = static_cast<int>(sizeof(key_t) * 8);

  extern __shared__ __align__(16) unsigned char smem[];
  const int k = static_cast<int>(p.k);
  const int k8 = (k + 7) / 8 * 8;
  auto* out_id = reinterpret_cast<int64_t*>(smem);
  auto* cand_key = reinterpret_cast<key_t*>(out_id + k8);
  auto* run_key = cand_key + cap;
  auto* cand_col = reinterpret_cast<int32_t*>(run_key + k8);
  auto* out_val = reinterpret_cast<scalar_t*>(cand_col + cap);
  __shared__ int s_count, s_ties, s_digit, s_above;
  __shared__ int hist[256];
  __shared__ int warp_ties[kWarps];

  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x % cuda::kWarp, warp = threadIdx.x / cuda::kWarp;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
  auto* values = static_cast<scalar_t*>(p.values) + row * p.k;
  int64_t* ids = p.indices + row * p.k;
  const auto* bias = static_cast<const scalar_t*>(p.bias);  // hugehead's loop lets the GEMM add it on CUDA
  auto value_of = [&](scalar_t raw, int64_t col) { return topk_value<scalar_t, acc_t, kSoftcap>(raw, bias, col, softcap); };
  auto key_of = [&](scalar_t raw, int64_t col) { return topk_key(value_of(raw, col)); };
  // Lanes past a row's end (e >= n) must not call key_of: with a bias it would read bias[col] out of bounds.

  const key_t bar = topk_threshold(values, ids, p.k);
  if (bar == kNaN) return;  // the k-th is NaN: nothing can rank above it
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();

  // 1. The common case: gather the values above the bar (usually none) while reading the row once.
  // With an empty slot left every value passes: a chunk wider than the buffer goes straight to 2.
  int survivors = static_cast<int>(p.cols);
  if (!(bar == key_t(0) && p.cols > cap)) {
    sweep_row<scalar_t, kUnroll>(z, p.cols, [&](const scalar_t* v, int64_t col0, int n) {
      key_t keys[V];
      unsigned pass = 0;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        keys[e] = (e < n ? key_of(v[e], col0 + e) : key_t(0));
        pass |= (e < n && keys[e] > bar) ? (1u << e) : 0u;
      }
      if (!__any_sync(kFull, pass != 0)) return;
      int slot = warp_claim(__popc(pass), &s_count);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if ((pass >> e) & 1u) {
          if (slot < cap) {
            cand_key[slot] = keys[e];
            cand_col[slot] = static_cast<int32_t>(col0 + e);
          }
          ++slot;
        }
      }
    });
    __syncthreads();
    survivors = s_count;
  }
  if (survivors == 0) return;

  if (survivors > cap) {
    // 2. Too many: the chunk's own top k among the values above the bar (at least k of them). Radix
    // select, 8 bits a pass from the top: the k-th key is `prefix`, and `remaining` ties at it are needed.
    key_t prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = kKeyBits - 8; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
      __syncthreads();
      sweep_row<scalar_t, kUnroll>(z, p.cols, [&](const scalar_t* v, int64_t col0, int n) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const key_t key = (e < n ? key_of(v[e], col0 + e) : key_t(0));
          const bool in = e < n && key > bar && (key & mask) == prefix;
          const int digit = in ? static_cast<int>((key >> shift) & 255) : -1;
          // Lanes with the same digit add once (the first chunk's keys crowd a few bins).
          const unsigned peers = __match_any_sync(kFull, digit);
          if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
      });
      __syncthreads();
      if (warp == 0) {
        // Lane l holds bins 255 - 8l .. 248 - 8l (from the top): which bin holds the remaining-th key?
        int counts[8], sum = 0;
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          counts[t] = hist[255 - 8 * lane - t];
          sum += counts[t];
        }
        const int incl = warp_inclusive_sum(sum);
        int above = incl - sum;
        if (above < remaining && remaining <= incl) {
#pragma unroll
          for (int t = 0; t < 8; ++t) {
            if (remaining <= above + counts[t]) {
              s_digit = 255 - 8 * lane - t;
              s_above = above;
              break;
            }
            above += counts[t];
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<key_t>(static_cast<key_t>(s_digit) << shift);
      mask |= static_cast<key_t>(static_cast<key_t>(255) << shift);
      remaining -= s_above;
      __syncthreads();  // s_digit / s_above are read before the next pass writes them
    }
    const key_t kth = prefix;
    const int need = remaining, n_above = k - remaining;
    if (threadIdx.x == 0) {
      s_count = 0;
      s_ties = 0;
    }
    __syncthreads();
    // One ordered pass: keys above the k-th anywhere in slots [0, n_above), ties at it by column into
    // [n_above, k) until `need` of them are in.
    sweep_row<scalar_t, 1>(z, p.cols, [&](const scalar_t* v, int64_t col0, int n) {
      key_t keys[V];
      unsigned above = 0, tie = 0;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        keys[e] = (e < n ? key_of(v[e], col0 + e) : key_t(0));
        above |= (e < n && keys[e] > kth) ? (1u << e) : 0u;
        tie |= (e < n && keys[e] == kth) ? (1u << e) : 0u;
      }
      const int ties = __popc(tie);
      const int incl = warp_inclusive_sum(ties);
      if (lane == cuda::kWarp - 1) warp_ties[warp] = incl;
      __syncthreads();
      int rank = s_ties + incl - ties, round_ties = 0;
      for (int w = 0; w < kWarps; ++w) {
        rank += w < warp ? warp_ties[w] : 0;
        round_ties += warp_ties[w];
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if ((tie >> e) & 1u) {
          if (rank < need) {
            cand_key[n_above + rank] = kth;
            cand_col[n_above + rank] = static_cast<int32_t>(col0 + e);
          }
          ++rank;
        }
      }
      if (__any_sync(kFull, above != 0)) {
        int slot = warp_claim(__popc(above), &s_count);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          if ((above >> e) & 1u) {
            cand_key[slot] = keys[e];
            cand_col[slot] = static_cast<int32_t>(col0 + e);
            ++slot;
          }
        }
      }
      __syncthreads();  // every thread has read s_ties and warp_ties
      if (threadIdx.x == 0) s_ties += round_ties;
    });
    survivors = k;
  }

  // 3. Sort the candidates by (key descending, column ascending), padded to a power of two with keys
  // of 0 (below any real key: they sort last).
  int padded = 1;
  while (padded < survivors) padded *= 2;
  for (int i = survivors + threadIdx.x; i < padded; i += blockDim.x) {
    cand_key[i] = key_t(0);
    cand_col[i] = std::numeric_limits<int32_t>::max();
  }
  for (int i = threadIdx.x; i < k; i += blockDim.x) run_key[i] = ids[i] >= 0 ? topk_key(values[i]) : key_t(0);
  __syncthreads();
  for (int size = 2; size <= padded; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < padded / 2; i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;  // "ascending" = best first
        const key_t kl = cand_key[lo], kh = cand_key[hi];
        const int32_t cl = cand_col[lo], ch = cand_col[hi];
        const bool hi_first = kh > kl || (kh == kl && ch < cl);
        if (hi_first == ascending) {
          cand_key[lo] = kh;
          cand_key[hi] = kl;
          cand_col[lo] = ch;
          cand_col[hi] = cl;
        }
      }
      __syncthreads();
    }
  }

  // 4. Merge by rank (on equal keys the running entry, a lower class id, goes first); positions before
  // the best candidate's keep their entries, the rest are staged and rewritten.
  const int first = count_leading<false>(run_key, k, cand_key[0]);
  for (int q = threadIdx.x; q < survivors; q += blockDim.x) {
    const int rank = q + count_leading<false>(run_key, k, cand_key[q]);
    if (rank < k) {
      out_val[rank - first] = value_of(z[cand_col[q]], cand_col[q]);
      out_id[rank - first] = p.class_start + cand_col[q];
    }
  }
  for (int i = first + threadIdx.x; i < k; i += blockDim.x) {
    const int rank = i + count_leading<true>(cand_key, survivors, run_key[i]);
    if (rank < k) {
      out_val[rank - first] = values[i];
      out_id[rank - first] = ids[i];
    }
  }
  __syncthreads();
  for (int i = first + threadIdx.x; i < k; i += blockDim.x) {
    values[i] = out_val[i - first];
    ids[i] = out_id[i - first];
  }
}

template <typename scalar_t, bool kSoftcap>
void launch(const ChunkTopkParams& p, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t cap = candidate_capacity(p.k);
  const size_t bytes = shared_bytes<scalar_t>(p.k, cap);
  auto* kernel = &chunk_topk_kernel<scalar_t, acc_t, kSoftcap>;
  // The opt-in is needed once static + dynamic shared memory passes 48 KiB (the kernel's static
  // arrays take ~1 KiB: k = 1024 in float64 needs exactly 48 KiB of dynamic memory and failed to launch).
  if (bytes > 32 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
  kernel<<<static_cast<unsigned>(p.rows), kThreads, bytes, stream>>>(p, static_cast<int>(cap));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void chunk_topk_cuda(const ChunkTopkParams& p, const at::Tensor& logits) {
  TORCH_CHECK(p.k <= kMaxK, "hugehead: the CUDA top-k kernel takes k <= ", kMaxK, ", got k = ", p.k);
  TORCH_CHECK(p.cols < std::numeric_limits<int32_t>::max(), "hugehead: a top-k chunk holds fewer than 2^31 "
              "classes, got ", p.cols);
  TORCH_CHECK(p.rows <= std::numeric_limits<int32_t>::max(), "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_topk_cuda", [&] {
    HUGEHEAD_BOOL_SWITCH(p.softcap > 0, kSoftcap, [&] { launch<scalar_t, kSoftcap>(p, stream); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("chunk_topk_", &entry::chunk_topk<chunk_topk_cuda>); }

}  // namespace hugehead
