// CUDA kernel of hugehead::sparse_chunk_stats_: one block per row folds a logits chunk into running
// (max, sumexp, logit_sum) as chunk_stats_ does, and adds the dot product of the row's CSR target
// entries in the chunk (found by binary search on its sorted columns) with their logits.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_launch.cuh"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"
#include "hugehead/sparse_target.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t, bool kSoftcap, bool kWeighted>
__global__ void __launch_bounds__(cuda::kRowThreads) sparse_chunk_stats_kernel(SparseChunkStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  const auto* weight = static_cast<const acc_t*>(p.class_weight);
  auto value = [&](scalar_t raw) {
    return kSoftcap ? apply_softcap(static_cast<acc_t>(raw), softcap) : static_cast<acc_t>(raw);
  };
  acc_t m = neg_inf<acc_t>(), s = 0, sum = 0;
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/false>(logits, p.cols, [&](int64_t j0, auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
    acc_t v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = value(pack.v[k]);
    if constexpr (kWeighted) {
      acc_t unweighted = 0;  // unused: the weighted sum replaces it
      cuda::fold_values(v, m, s, unweighted);
#pragma unroll
      for (int k = 0; k < N; ++k) sum += weight[j0 + k] * v[k];
    } else {
      cuda::fold_values(v, m, s, sum);
    }
  });
  cuda::block_reduce_lse(m, s, sum);
  if (threadIdx.x == 0) {
    lse_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row], m, s);
    static_cast<acc_t*>(p.logit_sum)[row] += sum;
  }
  // The row's entries in the chunk: the same range in every thread (uniform branch around the reduction).
  const EntryRange entries = chunk_entries(p.target.crow, p.target.col, row, p.class_start, p.cols);
  if (entries.end == entries.begin) return;
  const auto* val = static_cast<const acc_t*>(p.target.val);
  acc_t dot = 0;
  for (int64_t e = entries.begin + threadIdx.x; e < entries.end; e += blockDim.x) {
    dot += val[e] * value(logits[p.target.col[e] - p.class_start]);
  }
  dot = cuda::block_sum(dot);
  if (threadIdx.x == 0) static_cast<acc_t*>(p.target_dot)[row] += dot;
}

void sparse_chunk_stats_cuda(const SparseChunkStatsParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "sparse_chunk_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    HUGEHEAD_BOOL_SWITCH(p.softcap > 0, kSoftcap, [&] {
      HUGEHEAD_BOOL_SWITCH(p.class_weight != nullptr, kWeighted, [&] {
        cuda::launch_row_blocks(sparse_chunk_stats_kernel<scalar_t, acc_t, kSoftcap, kWeighted>, p, logits);
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("sparse_chunk_stats_", &entry::sparse_chunk_stats<sparse_chunk_stats_cuda>); }

}  // namespace hugehead
