// CUDA implementation of hugehead::gemm_dx_ and hugehead::gemm_dw_ (CUDA builds with CUTLASS only): the
// backward's dX and dW GEMMs on a chunk's dLoss/dlogits (dense_gemm.cuh), in place of cuBLAS's mm / addmm.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "hugehead/common.h"
#include "hugehead/gemm.h"
#include "operand_checks.h"

namespace hugehead {
namespace {

// The three operands as the TMA loads and stores take them: 2 dims, unit column stride, 16-byte aligned.
void check_dense(const at::Tensor& out, const at::Tensor& g, const at::Tensor& b, const char* op, const char* b_name,
                 int64_t out_rows, int64_t b_rows) {
  TORCH_CHECK(g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kHalf, "hugehead: ", op,
              " takes a bfloat16 or float16 g, got ", g.scalar_type());
  TORCH_CHECK(b.scalar_type() == g.scalar_type(), "hugehead: ", op, ": ", b_name, " must be ", g.scalar_type(),
              ", got ", b.scalar_type());
  TORCH_CHECK(out.device() == g.device() && b.device() == g.device(), "hugehead: ", op,
              ": out, g and ", b_name, " must be on one device, got ", out.device(), ", ", g.device(), ", ",
              b.device());
  check_k_major(g, "g");
  check_k_major(b, b_name);
  TORCH_CHECK(out.dim() == 2, "hugehead: out must have 2 dims, got shape ", out.sizes());
  TORCH_CHECK(out.size(0) == out_rows && out.size(1) == b.size(1) && b.size(0) == b_rows, "hugehead: ", op,
              ": shapes do not match: out ", out.sizes(), ", g ", g.sizes(), ", ", b_name, " ", b.sizes());
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1, "hugehead: out must have unit column stride, got strides ",
              out.strides());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0 && (out.stride(0) * out.element_size()) % 16 == 0,
              "hugehead: out must be 16-byte aligned with 16-byte aligned rows (TMA), got stride ", out.stride(0));
  TORCH_CHECK(b.size(1) > 0 && b.size(1) % 8 == 0, "hugehead: ", op,
              " needs a positive feature count divisible by 8, got ", b.size(1));
  // The K extent of dX's K-major g and the M extent of dW's M-major g^T: TMA's contiguous extent, whole 16 bytes.
  TORCH_CHECK(g.size(1) % 8 == 0, "hugehead: ", op, " needs g with a multiple of 8 columns (TMA), got ", g.size(1));
  TORCH_CHECK(g.size(0) < std::numeric_limits<int32_t>::max() && g.size(1) < std::numeric_limits<int32_t>::max(),
              "hugehead: too many rows or classes in one chunk for ", op);
}

void run_dense(const at::Tensor& out, const at::Tensor& g, const at::Tensor& b, bool accumulate,
               gemm::DenseKind kind) {
  const int64_t rows = g.size(0), cols = g.size(1), depth = b.size(1);
  if (rows == 0 || cols == 0) {  // an empty sum: out = 0, or unchanged
    if (!accumulate) out.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(g.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  gemm::DenseGemmParams p{g.data_ptr(),   g.stride(0), b.data_ptr(), b.stride(0), out.data_ptr(),
                          out.stride(0), rows,        cols,         depth,       out.scalar_type() == at::kFloat,
                          accumulate,    at::cuda::getCurrentDeviceProperties()->multiProcessorCount};
  const bool half = g.scalar_type() == at::kHalf;
  const gemm::DenseConfig config = gemm::dense_config_from_env();
  const size_t ws_bytes = gemm::dense_gemm_workspace_bytes(p, half, kind, config);
  at::Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, g.options().dtype(at::kByte));
  const char* error =
      gemm::run_dense_gemm(p, half, kind, config, ws_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(error == nullptr, "hugehead: ", error == nullptr ? "" : error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gemm_dx_cuda(const at::Tensor& out, const at::Tensor& g, const at::Tensor& weight, bool accumulate) {
  check_dense(out, g, weight, "gemm_dx_", "weight", g.size(0), g.size(1));
  TORCH_CHECK(out.scalar_type() == at::kFloat, "hugehead: gemm_dx_ writes a float32 out, got ", out.scalar_type());
  run_dense(out, g, weight, accumulate, gemm::DenseKind::kDx);
}

void gemm_dw_cuda(const at::Tensor& out, const at::Tensor& g, const at::Tensor& x, bool accumulate) {
  check_dense(out, g, x, "gemm_dw_", "x", g.size(1), g.size(0));
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == g.scalar_type(),
              "hugehead: gemm_dw_ writes out in float32 or g's dtype (", g.scalar_type(), "), got ",
              out.scalar_type());
  TORCH_CHECK(!accumulate || out.scalar_type() == at::kFloat,
              "hugehead: gemm_dw_ accumulates into a float32 out only, got ", out.scalar_type());
  run_dense(out, g, x, accumulate, gemm::DenseKind::kDw);
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) {
  m.impl("gemm_dx_", &gemm_dx_cuda);
  m.impl("gemm_dw_", &gemm_dw_cuda);
}

}  // namespace hugehead
