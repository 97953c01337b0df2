// CUDA kernel of hugehead::chunk_grad_: one block per row turns a logits chunk into its gradient in
// place (16-byte loads and stores where the row allows).
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
  cuda::for_each_in_row<scalar_t, /*Write=*/true>(logits, p.cols, [&](int64_t j, scalar_t& v) {
    const acc_t d = logit_grad(static_cast<acc_t>(v), j == t, lse, g, gl, z_term, smooth, acc_t(1) - eps,
                               softcap);
    v = static_cast<scalar_t>(d);
  });
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
