// Argument checks both fused-GEMM ops share (x, weight, bias as the TMA mainloop takes them), with messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <optional>

namespace hugehead {

inline void check_k_major(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, "hugehead: ", name, " must have 2 dims, got shape ", t.sizes());
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "hugehead: ", name, " must have unit column stride, got strides ",
              t.strides());
  TORCH_CHECK(t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "hugehead: ", name, " must be 16-byte aligned with a row stride that is a multiple of 8 elements "
              "(TMA), got stride ", t.stride(0));
}

// x [N, D] and weight [C, D] bf16/fp16, K-major, D a positive multiple of 8; bias [C] contiguous or none.
inline void check_gemm_operands(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "hugehead: ", op,
              " takes bfloat16 or float16 x, got ", x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "hugehead: weight must be ", x.scalar_type(), ", got ",
              weight.scalar_type());
  TORCH_CHECK(weight.device() == x.device(), "hugehead: weight is on ", weight.device(), " but x is on ",
              x.device());
  check_k_major(x, "x");
  check_k_major(weight, "weight");
  TORCH_CHECK(weight.size(1) == x.size(1), "hugehead: weight has ", weight.size(1), " features but x has ",
              x.size(1));
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % 8 == 0, "hugehead: ", op,
              " needs a positive feature count divisible by 8, got ", x.size(1));
  TORCH_CHECK(x.size(0) < std::numeric_limits<int32_t>::max() && weight.size(0) < std::numeric_limits<int32_t>::max(),
              "hugehead: too many rows or classes in one chunk for ", op);
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK(b.dim() == 1 && b.size(0) == weight.size(0), "hugehead: bias must have shape [", weight.size(0),
                "], got ", b.sizes());
    TORCH_CHECK(b.scalar_type() == x.scalar_type(), "hugehead: bias must be ", x.scalar_type(), ", got ",
                b.scalar_type());
    TORCH_CHECK(b.device() == x.device(), "hugehead: bias is on ", b.device(), " but x is on ", x.device());
    TORCH_CHECK(b.is_contiguous(), "hugehead: bias must be contiguous");
  }
}

}  // namespace hugehead
