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
#include "operand_checks.h"

namespace hugehead {
namespace {

void gemm_chunk_grad_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& target, int64_t class_start, int64_t num_classes, const at::Tensor& lse,
                          const at::Tensor& grad_rows, double label_smoothing, double z_loss, double softcap,
                          const std::optional<at::Tensor>& grad_lse, const at::Tensor& grad_logits, bool exact) {
  check_gemm_operands(x, weight, bias, "gemm_chunk_grad_");
  TORCH_CHECK(!exact || (!bias.has_value() && !(softcap > 0.0)),
              "hugehead: gemm_chunk_grad_ with exact=True takes no bias or softcap (the float32 accumulator is the "
              "logit only there)");
  TORCH_CHECK(num_classes > 0, "hugehead: num_classes must be positive, got ", num_classes);
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
  p.exact = exact;
  const bool half = x.scalar_type() == at::kHalf;
  const gemm::Schedule schedule = gemm::default_grad_schedule(x.size(1));
  const size_t ws_bytes = gemm::grad_gemm_workspace_bytes(p, half, schedule);
  at::Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const char* error = gemm::run_grad_gemm(p, half, schedule, ws_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(error == nullptr, "hugehead: ", error == nullptr ? "" : error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("gemm_chunk_grad_", &gemm_chunk_grad_cuda); }

}  // namespace hugehead
