// CUDA kernel of hugehead::chunk_stats_: one block per row folds a logits chunk into running
// (max, sumexp, target logit, sum of logits) with an online log-sum-exp in the accumulation type, one
// exp per element (the running sum is rescaled per 16-byte pack, not per element; the target logit is
// read once, not compared for at every element).
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_launch.cuh"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t, bool kSoftcap>
__global__ void __launch_bounds__(cuda::kRowThreads) chunk_stats_kernel(ChunkStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const int64_t t = p.target[row] - p.class_start;
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  auto value = [&](scalar_t raw) {
    return kSoftcap ? apply_softcap(static_cast<acc_t>(raw), softcap) : static_cast<acc_t>(raw);
  };
  acc_t m = neg_inf<acc_t>(), s = 0, sum = 0;
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/false, /*kUnroll=*/4>(logits, p.cols, [&](auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
    acc_t v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = value(pack.v[k]);
    cuda::fold_values(v, m, s, sum);
  });
  if (threadIdx.x == 0 && t >= 0 && t < p.cols) static_cast<acc_t*>(p.target_logit)[row] = value(logits[t]);
  cuda::block_reduce_lse(m, s, sum);
  if (threadIdx.x == 0) {
    lse_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row], m, s);
    static_cast<acc_t*>(p.logit_sum)[row] += sum;
  }
}

void chunk_stats_cuda(const ChunkStatsParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_stats_cuda", [&] {
    HUGEHEAD_BOOL_SWITCH(p.softcap > 0, kSoftcap, [&] {
      cuda::launch_row_blocks(chunk_stats_kernel<scalar_t, at::opmath_type<scalar_t>, kSoftcap>, p, logits);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("chunk_stats_", &entry::chunk_stats<chunk_stats_cuda>); }

}  // namespace hugehead
