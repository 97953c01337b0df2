// CUDA kernel of hugehead::chunk_stats_: one block per row folds a logits chunk into running
// (max, sumexp, target logit, sum of logits) with an online log-sum-exp in the accumulation type.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cuda_utils.cuh"

namespace hugehead {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) chunk_stats_kernel(ChunkStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const int64_t t = p.target[row] - p.class_start;
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  acc_t m = neg_inf<acc_t>(), s = 0, sum = 0;
  cuda::for_each_in_row<scalar_t, /*Write=*/false>(logits, p.cols, [&](int64_t j, scalar_t& raw) {
    const acc_t v = apply_softcap(static_cast<acc_t>(raw), softcap);
    if (v > m) {
      // s * 0 (not a literal 0) when m is still -inf: a NaN already in s must survive.
      s = s * (m == neg_inf<acc_t>() ? acc_t(0) : cuda::fast_exp(m - v)) + acc_t(1);
      m = v;
    } else {
      s += v == neg_inf<acc_t>() ? acc_t(0) : cuda::fast_exp(v - m);  // NaN v makes s NaN
    }
    sum += v;
    if (j == t) static_cast<acc_t*>(p.target_logit)[row] = v;
  });
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
    chunk_stats_kernel<scalar_t, acc_t><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("chunk_stats_", &chunk_stats_cuda); }

}  // namespace hugehead
