// CUDA kernel of hugehead::chunk_grad_: one block per row turns a logits chunk into its gradient in
// place (16-byte loads and stores where the row allows, two in flight per thread).
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

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) chunk_grad_kernel(ChunkGradParams p) {
  const int64_t row = blockIdx.x;
  scalar_t* logits = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
  const acc_t g = static_cast<const acc_t*>(p.grad_rows)[row];
  const acc_t gl = p.grad_lse == nullptr ? acc_t(0) : static_cast<const acc_t*>(p.grad_lse)[row];
  if (g == acc_t(0) && gl == acc_t(0)) {  // ignored rows: exact zeros, whatever the logits hold
    cuda::for_each_in_row<scalar_t, /*Write=*/true>(logits, p.cols,
                                                    [&](int64_t, scalar_t& v) { v = scalar_t(0); });
    return;
  }
  const acc_t lse = static_cast<const acc_t*>(p.lse)[row];
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const acc_t eps = static_cast<acc_t>(p.label_smoothing);
  const acc_t smooth = eps / static_cast<acc_t>(p.num_classes);
  const acc_t z_term = acc_t(2) * static_cast<acc_t>(p.z_loss) * lse;
  const int64_t t = p.target[row] - p.class_start;
  const bool has_target = t >= 0 && t < p.cols;
  // The target's logit is read before any thread overwrites it; every element is then written with the
  // non-target formula (no index compare per element) and thread 0 rewrites the target's afterwards.
  __shared__ acc_t target_z;
  if (has_target) {
    if (threadIdx.x == 0) target_z = static_cast<acc_t>(logits[t]);
    __syncthreads();
  }
  auto grad = [&](acc_t z, bool is_target) {
    return logit_grad(z, is_target, lse, g, gl, z_term, smooth, acc_t(1) - eps, softcap);
  };
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/true>(logits, p.cols, [&](auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
    for (int k = 0; k < N; ++k) pack.v[k] = static_cast<scalar_t>(grad(static_cast<acc_t>(pack.v[k]), false));
  });
  if (has_target) {
    __syncthreads();
    if (threadIdx.x == 0) logits[t] = static_cast<scalar_t>(grad(target_z, true));
  }
}

void chunk_grad_cuda(const at::Tensor& logits, const at::Tensor& target, int64_t class_start,
                     int64_t num_classes, const at::Tensor& lse, const at::Tensor& grad_rows,
                     double label_smoothing, double z_loss, double softcap,
                     const std::optional<at::Tensor>& grad_lse) {
  check_chunk_rows(logits, target, {{"lse", &lse}, {"grad_rows", &grad_rows}});
  if (grad_lse.has_value()) check_chunk_rows(logits, target, {{"grad_lse", &*grad_lse}});
  TORCH_CHECK(num_classes > 0, "hugehead: num_classes must be positive, got ", num_classes);
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(), "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  ChunkGradParams p{logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr(), grad_rows.data_ptr(),
                    grad_lse.has_value() ? grad_lse->data_ptr() : nullptr,
                    logits.size(0), logits.size(1), logits.stride(0), class_start, num_classes,
                    label_smoothing, z_loss, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    chunk_grad_kernel<scalar_t, acc_t><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("chunk_grad_", &chunk_grad_cuda); }

}  // namespace hugehead
