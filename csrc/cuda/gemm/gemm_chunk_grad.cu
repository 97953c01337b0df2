// CUDA implementation of hugehead::gemm_chunk_grad_ (CUDA builds with CUTLASS only): the backward's
// recompute GEMM (grad_gemm.cuh) writes dLoss/dlogits of the chunk x W_c^T + b_c straight into grad_logits,
// which the dX and dW GEMMs read next; no logits are stored and no chunk_grad_ pass runs.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <optional>

#include "hugehead/common.h"
#include "hugehead/gemm.h"

namespace hugehead {
namespace {

void check_k_major(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, "hugehead: ", name, " must have 2 dims, got shape ", t.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "hugehead: ", name, " must have unit column stride, got strides ",
              t.strides());
  TORCH_CHECK(t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "hugehead: ", name, " must be 16-byte aligned with a row stride that is a multiple of 8 elements "
              "(TMA), got stride ", t.stride(0));
}

void gemm_chunk_grad_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& target, int64_t class_start, int64_t num_classes, const at::Tensor& lse,
                          const at::Tensor& grad_rows, double label_smoothing, double z_loss, double softcap,
                          const std::optional<at::Tensor>& grad_lse, const at::Tensor& grad_logits) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "hugehead: gemm_chunk_grad_ takes bfloat16 or float16 x, got ", x.scalar_type());
  HUGEHEAD_CHECK_DTYPE(weight, x.scalar_type());
  HUGEHEAD_CHECK_DEVICE(weight, x);
  check_k_major(x, "x");
  check_k_major(weight, "weight");
  TORCH_CHECK(weight.size(1) == x.size(1), "hugehead: weight has ", weight.size(1), " features but x has ",
              x.size(1));
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % 8 == 0,
              "hugehead: gemm_chunk_grad_ needs a positive feature count divisible by 8, got ", x.size(1));
  TORCH_CHECK(x.size(0) < std::numeric_limits<int32_t>::max() && weight.size(0) < std::numeric_limits<int32_t>::max(),
              "hugehead: too many rows or classes in one chunk for gemm_chunk_grad_");
  TORCH_CHECK(num_classes > 0, "hugehead: num_classes must be positive, got ", num_classes);
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == weight.size(0), "hugehead: bias must have shape [", weight.size(0),
                "], got ", b.sizes());
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), "hugehead: bias must be ", x.scalar_type(), ", got ",
                b.scalar_type());
    TORCH_CHECK(b.device() == x.device(), "hugehead: bias is on ", b.device(), " but x is on ", x.device());
    TORCH_CHECK(b.is_contiguous(), "hugehead: bias must be contiguous");
  }
  TORCH_CHECK(grad_logits.dim() == 2 && grad_logits.size(0) == x.size(0) && grad_logits.size(1) == weight.size(0),
              "hugehead: grad_logits must have shape [", x.size(0), ", ", weight.size(0), "], got ",
              grad_logits.sizes());
  TORCH_CHECK(grad_logits.scalar_type() == x.scalar_type(), "hugehead: grad_logits must be ", x.scalar_type(),
              ", got ", grad_logits.scalar_type());
  TORCH_CHECK(grad_logits.device() == x.device(), "hugehead: grad_logits is on ", grad_logits.device(),
              " but x is on ", x.device());
  TORCH_CHECK(grad_logits.size(1) <= 1 || grad_logits.stride(1) == 1,
              "hugehead: grad_logits must have unit column stride, got strides ", grad_logits.strides());
  check_chunk_rows(grad_logits, target, {{"lse", &lse}, {"grad_rows", &grad_rows}});
  if (grad_lse.has_value()) check_chunk_rows(grad_logits, target, {{"grad_lse", &*grad_lse}});
  const int64_t rows = x.size(0), cols = weight.size(0);
  if (rows == 0 || cols == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  gemm::GradGemmParams p{x.data_ptr(), weight.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr,
                         target.data_ptr<int64_t>(), lse.data_ptr<float>(), grad_rows.data_ptr<float>(),
                         grad_lse.has_value() ? grad_lse->data_ptr<float>() : nullptr, grad_logits.data_ptr(),
                         grad_logits.stride(0), rows, cols, x.size(1), x.stride(0), weight.stride(0), class_start,
                         num_classes, static_cast<float>(label_smoothing), static_cast<float>(z_loss),
                         static_cast<float>(softcap), at::cuda::getCurrentDeviceProperties()->multiProcessorCount};
  const bool half = x.scalar_type() == at::kHalf;
  const size_t ws_bytes = gemm::grad_gemm_workspace_bytes(p, half);
  at::Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const char* error = gemm::run_grad_gemm(p, half, ws_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(error == nullptr, "hugehead: ", error == nullptr ? "" : error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("gemm_chunk_grad_", &gemm_chunk_grad_cuda); }

}  // namespace hugehead
