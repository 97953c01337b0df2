// CUDA kernel of hugehead::chunk_stats_: one block per row folds a logits chunk into running
// (max, sumexp, target logit, sum of logits) with an online log-sum-exp in the accumulation type, one
// exp per element (the running sum is rescaled per 16-byte pack, not per element; the target logit is
// read once, not compared for at every element).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_utils.cuh"

namespace hugehead {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t, typename acc_t, bool kSoftcap>
__global__ void __launch_bounds__(kThreads) chunk_stats_kernel(ChunkStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const int64_t t = p.target[row] - p.class_start;
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  auto value = [&](scalar_t raw) {
    return kSoftcap ? apply_softcap(static_cast<acc_t>(raw), softcap) : static_cast<acc_t>(raw);
  };
  acc_t m = neg_inf<acc_t>(), s = 0, sum = 0;
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/false>(logits, p.cols, [&](auto& pack) {
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

void chunk_stats_cuda(const at::Tensor& logits_in, const at::Tensor& target, int64_t class_start,
                      double softcap, const at::Tensor& row_max, const at::Tensor& row_sumexp,
                      const at::Tensor& target_logit, const at::Tensor& logit_sum) {
  const at::Tensor logits = logits_in.dim() == 2 && logits_in.size(1) > 1 && logits_in.stride(1) != 1
                                ? logits_in.contiguous()
                                : logits_in;
  check_chunk_rows(logits, target,
                   {{"row_max", &row_max}, {"row_sumexp", &row_sumexp},
                    {"target_logit", &target_logit}, {"logit_sum", &logit_sum}});
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(), "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  ChunkStatsParams p{logits.data_ptr(), target.data_ptr<int64_t>(), row_max.data_ptr(),
                     row_sumexp.data_ptr(), target_logit.data_ptr(), logit_sum.data_ptr(),
                     logits.size(0), logits.size(1), logits.stride(0), class_start, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    if (p.softcap > 0) {
      chunk_stats_kernel<scalar_t, acc_t, true><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    } else {
      chunk_stats_kernel<scalar_t, acc_t, false><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("chunk_stats_", &chunk_stats_cuda); }

}  // namespace hugehead
