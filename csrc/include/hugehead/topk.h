// Shared by the CPU and CUDA top-k kernels: the params struct, the value a logit ranks by (softcap
// applied, rounded to the logits' dtype, as the values are returned) and order-preserving integer keys.
//
// The order: value descending, NaN above +inf (every NaN equal), -0 equal to +0, ties to the lower class
// id. An integer key maps it onto unsigned comparison: key(a) > key(b) exactly when a ranks above b
// before the id tie-break. Key 0 is never a real value's key (-inf's is above it): it marks an empty slot
// of the running top-k (index -1), which every real value beats.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "hugehead/numerics.h"

namespace hugehead {

// Fold one logits chunk [N, C] (classes class_start .. class_start+C-1, all above every id already in
// the running top-k) into the running per-row top-k, in place.
struct ChunkTopkParams {
  const void* logits;  // [N, C] scalar_t, row stride row_stride elements, column stride 1
  const void* bias;    // [C] scalar_t added to every row first, or nullptr
  void* values;        // [N, k] scalar_t, contiguous: sorted, best first
  int64_t* indices;    // [N, k] int64 global class ids; -1 marks an empty slot (a suffix of the row)
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t k;
  int64_t class_start;
  double softcap;  // <= 0: none
};

template <typename scalar_t>
struct TopkKey;
template <>
struct TopkKey<c10::BFloat16> {
  using type = uint16_t;
  static constexpr uint16_t kInfBits = 0x7F80;
};
template <>
struct TopkKey<c10::Half> {
  using type = uint16_t;
  static constexpr uint16_t kInfBits = 0x7C00;
};
template <>
struct TopkKey<float> {
  using type = uint32_t;
  static constexpr uint32_t kInfBits = 0x7F800000u;
};
template <>
struct TopkKey<double> {
  using type = uint64_t;
  static constexpr uint64_t kInfBits = 0x7FF0000000000000ull;
};

template <typename scalar_t>
using topk_key_t = typename TopkKey<scalar_t>::type;

template <typename U>
C10_HOST_DEVICE inline U topk_key_from_bits(U bits, U inf_bits) {
  constexpr U sign = static_cast<U>(U(1) << (sizeof(U) * 8 - 1));
  const U magnitude = static_cast<U>(bits & static_cast<U>(~sign));
  const U flipped = (bits & sign) ? static_cast<U>(~bits) : static_cast<U>(bits | sign);
  // NaN (any payload, either sign): the largest key; -0 and +0: the same key.
  return magnitude > inf_bits ? static_cast<U>(~U(0)) : (magnitude == 0 ? sign : flipped);
}

template <typename scalar_t>
C10_HOST_DEVICE inline topk_key_t<scalar_t> topk_key(scalar_t v) {
  using U = topk_key_t<scalar_t>;
  U bits;
  std::memcpy(&bits, &v, sizeof(U));  // c10::Half / c10::BFloat16 hold exactly their 16 bits
  return topk_key_from_bits<U>(bits, TopkKey<scalar_t>::kInfBits);
}

// The value a logit ranks by and is returned as: the bias added and the softcap applied in acc_t, rounded
// back to scalar_t once (as a GEMM's bias epilogue rounds).
template <typename scalar_t, typename acc_t, bool kSoftcap>
C10_HOST_DEVICE inline scalar_t topk_value(scalar_t raw, const scalar_t* bias, int64_t col, acc_t softcap) {
  if (!kSoftcap && bias == nullptr) return raw;
  acc_t v = static_cast<acc_t>(raw);
  if (bias != nullptr) v += static_cast<acc_t>(bias[col]);
  return static_cast<scalar_t>(kSoftcap ? apply_softcap(v, softcap) : v);
}

// The k-th running value's key, the bar a later chunk's value must pass strictly (ties go to the
// running entry, whose id is lower); 0 while the row still has an empty slot.
template <typename scalar_t>
C10_HOST_DEVICE inline topk_key_t<scalar_t> topk_threshold(const scalar_t* values, const int64_t* indices,
                                                          int64_t k) {
  return indices[k - 1] >= 0 ? topk_key(values[k - 1]) : topk_key_t<scalar_t>(0);
}

}  // namespace hugehead

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace hugehead {

// Argument checks of chunk_topk_ shared by both backends (logits: unit column stride already ensured).
inline void check_chunk_topk(const at::Tensor& logits, const c10::optional<at::Tensor>& bias,
                             const at::Tensor& values, const at::Tensor& indices, int64_t class_start) {
  TORCH_CHECK(logits.dim() == 2, "hugehead: logits must have 2 dims, got shape ", logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), "hugehead: logits must be floating point, got ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1,
              "hugehead: logits chunk must have unit column stride, got strides ", logits.strides());
  TORCH_CHECK(values.dim() == 2 && values.size(0) == logits.size(0) && values.size(1) >= 1,
              "hugehead: values must have shape [", logits.size(0), ", k >= 1], got ", values.sizes());
  TORCH_CHECK(indices.sizes() == values.sizes(), "hugehead: indices must have the shape of values ",
              values.sizes(), ", got ", indices.sizes());
  TORCH_CHECK(values.scalar_type() == logits.scalar_type(), "hugehead: values must be ", logits.scalar_type(),
              " like the logits, got ", values.scalar_type());
  TORCH_CHECK(indices.scalar_type() == at::kLong, "hugehead: indices must be int64, got ", indices.scalar_type());
  TORCH_CHECK(values.device() == logits.device() && indices.device() == logits.device(),
              "hugehead: values and indices must be on the logits' device ", logits.device(), ", got ",
              values.device(), " and ", indices.device());
  TORCH_CHECK(values.is_contiguous() && indices.is_contiguous(), "hugehead: values and indices must be contiguous");
  TORCH_CHECK(class_start >= 0, "hugehead: class_start must be >= 0, got ", class_start);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == logits.size(1), "hugehead: bias must have shape [",
                logits.size(1), "], got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == logits.scalar_type(), "hugehead: bias must be ", logits.scalar_type(),
                " like the logits, got ", bias->scalar_type());
    TORCH_CHECK(bias->device() == logits.device(), "hugehead: bias is on ", bias->device(), " but the logits on ",
                logits.device());
    TORCH_CHECK(bias->is_contiguous(), "hugehead: bias must be contiguous");
  }
}

}  // namespace hugehead
