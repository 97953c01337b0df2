// CUDA kernels of hugehead::entropy_chunk_stats_ and entropy_chunk_grad_: the log-probability loss with the
// entropy of each row's softmax. One block per row: each thread folds its columns into an online (max, sumexp,
// shifted sum) triple, the block merges the triples in a fixed tree (deterministic); the gradient is elementwise.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_launch.cuh"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(cuda::kRowThreads) entropy_stats_kernel(EntropyStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const scalar_t* logits = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
  acc_t m = neg_inf<acc_t>(), s = 0, a = 0;
  for (int64_t j = threadIdx.x; j < p.cols; j += blockDim.x) {
    const acc_t v = apply_softcap(static_cast<acc_t>(logits[j]), softcap);
    entropy_merge(m, s, a, v, v == neg_inf<acc_t>() ? acc_t(0) : (v != v ? v : acc_t(1)), acc_t(0));
  }
  cuda::block_reduce_triple<cuda::kRowThreads>(m, s, a, entropy_merge<acc_t>);
  if (threadIdx.x == 0) {
    entropy_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row],
                  static_cast<acc_t*>(p.logit_sum)[row], m, s, a);
    const int64_t t = p.target[row] - p.class_start;
    if (t >= 0 && t < p.cols) {
      static_cast<acc_t*>(p.target_logit)[row] = apply_softcap(static_cast<acc_t>(logits[t]), softcap);
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(cuda::kRowThreads) entropy_grad_kernel(EntropyGradParams p) {
  const int64_t row = blockIdx.x;
  scalar_t* logits = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
  const acc_t g = static_cast<const acc_t*>(p.grad_rows)[row];
  const acc_t ge = static_cast<const acc_t*>(p.grad_entropy)[row];
  if (g == acc_t(0) && ge == acc_t(0)) {  // ignored rows: exact zeros, whatever the logits hold
    cuda::zero_row(logits, p.cols);
    return;
  }
  const acc_t lse = static_cast<const acc_t*>(p.lse)[row];
  const acc_t entropy = static_cast<const acc_t*>(p.entropy)[row];
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const int64_t t = p.target[row] - p.class_start;
  for (int64_t j = threadIdx.x; j < p.cols; j += blockDim.x) {
    logits[j] = static_cast<scalar_t>(
        entropy_logit_grad(static_cast<acc_t>(logits[j]), j == t, lse, g, ge, entropy, softcap));
  }
}

void entropy_chunk_stats_cuda(const EntropyStatsParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "entropy_chunk_stats_cuda", [&] {
    cuda::launch_row_blocks(entropy_stats_kernel<scalar_t, at::opmath_type<scalar_t>>, p, logits);
  });
}

void entropy_chunk_grad_cuda(const EntropyGradParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "entropy_chunk_grad_cuda", [&] {
    cuda::launch_row_blocks(entropy_grad_kernel<scalar_t, at::opmath_type<scalar_t>>, p, logits);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) {
  m.impl("entropy_chunk_stats_", &entry::chunk_stats<entropy_chunk_stats_cuda>);
  m.impl("entropy_chunk_grad_", &entry::entropy_chunk_grad<entropy_chunk_grad_cuda>);
}

}  // namespace hugehead
