// Sparse [N, V] targets in the kernels (CPU and CUDA): the CSR view of a chunk's entries, the params
// structs of the sparse-target ops, their argument checks, and the per-element math of one-vs-all binary
// cross-entropy, shared so both backends compute one formula (the softmax with probability targets shares
// numerics.h's sparse_logit_grad with the one-hot loss).
//
// A target reaches a kernel as CSR: crow [R + 1] (absolute offsets into col / val, so a row block of a
// larger target is just a slice of crow), col [nnz] global class ids sorted ascending within each row,
// duplicate-free, and val [nnz] in the accumulation dtype. A row's entries that fall in the chunk
// [class_start, class_start + C) are found by two binary searches on its sorted columns: rows are never
// scanned densely.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "hugehead/numerics.h"

#ifndef __CUDACC_RTC__
#include "hugehead/common.h"
#endif

namespace hugehead {

// First position p in [lo, hi) with col[p] >= key (col ascending on [lo, hi)), hi when there is none.
C10_HOST_DEVICE inline int64_t lower_bound(const int64_t* col, int64_t lo, int64_t hi, int64_t key) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (col[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The entries [begin, end) of CSR row `row` whose class ids fall in [class_start, class_start + cols).
struct EntryRange {
  int64_t begin;
  int64_t end;
};

C10_HOST_DEVICE inline EntryRange chunk_entries(const int64_t* crow, const int64_t* col, int64_t row,
                                                int64_t class_start, int64_t cols) {
  const int64_t lo = crow[row], hi = crow[row + 1];
  if (lo == hi || col[lo] >= class_start + cols || col[hi - 1] < class_start) return {lo, lo};
  const int64_t b = lower_bound(col, lo, hi, class_start);
  return {b, lower_bound(col, b, hi, class_start + cols)};
}

// The CSR target of an op (pointers into crow / col / val as described above).
struct CsrTarget {
  const int64_t* crow;  // [R + 1]
  const int64_t* col;   // [nnz]
  const void* val;      // [nnz] acc_t
};

// sparse_chunk_stats_: fold a logits chunk into running (max, sumexp, target_dot, logit_sum).
struct SparseChunkStatsParams {
  const void* logits;  // [R, C], row stride row_stride, column stride 1
  CsrTarget target;
  const void* class_weight;  // [C] acc_t weights of the chunk's classes for logit_sum, or nullptr (all 1)
  void* row_max;             // [R] acc_t
  void* row_sumexp;          // [R] acc_t
  void* target_dot;          // [R] acc_t: += sum over the row's entries in the chunk of val * logit
  void* logit_sum;           // [R] acc_t: += sum over the chunk of class_weight_j * logit_j
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t class_start;
  double softcap;  // <= 0: none
};

// sparse_chunk_grad_: a logits chunk becomes dLoss/dlogits in place.
struct SparseChunkGradParams {
  void* logits;  // [R, C] in/out
  CsrTarget target;
  const void* class_weight;  // [C] acc_t, or nullptr: label smoothing's eps / V per class is scaled by it
  const void* lse;           // [R] acc_t
  const void* grad_rows;     // [R] acc_t: dL/dloss_row (0: the row is written as zeros)
  const void* target_mass;   // [R] acc_t: the factor of softmax in the row's gradient (see sparse_logit_grad)
  const void* grad_lse;      // [R] acc_t or nullptr
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t class_start;
  int64_t num_classes;
  double label_smoothing;
  double z_loss;
  double softcap;
};

// bce_chunk_: per-logit one-vs-all losses of a chunk summed into row_loss, and/or the chunk replaced by
// grad_rows * dLoss/dlogits in place.
struct BceChunkParams {
  void* logits;  // [R, C]: read, and overwritten by the gradient when grad_rows is set
  CsrTarget target;
  const void* entry_weight;  // [nnz] acc_t: 1 + (pos_weight_j - 1) t of each entry, or nullptr (all 1)
  void* row_loss;            // [R] acc_t, or nullptr: += sum of the chunk's per-logit losses
  const void* grad_rows;     // [R] acc_t, or nullptr: no gradient
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t class_start;
};

// a / b for b in [1, 3] (the divisions below): the hardware's approximate division in float32 device code
// (2 ulp there), exact elsewhere.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t div_small(acc_t a, acc_t b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(acc_t) == sizeof(float)) return __fdividef(a, b);
#endif
  return a / b;
}

// log(1 + e) for e in [0, 1] as 2 atanh(s), s = e / (2 + e) in [0, 1/3]: no cancellation for small e (a
// confident negative's loss is about e, and must not round away), relative error ~1e-9 before rounding.
// Made of arithmetic only, so the CPU loops vectorize it.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t log1p_unit(acc_t e) {
  if constexpr (sizeof(acc_t) == sizeof(double)) return std::log1p(e);  // float64 (gradcheck): exact
  const acc_t s = div_small(e, acc_t(2) + e);
  const acc_t s2 = s * s;
  acc_t p = acc_t(1) / acc_t(15);
  p = p * s2 + acc_t(1) / acc_t(13);
  p = p * s2 + acc_t(1) / acc_t(11);
  p = p * s2 + acc_t(1) / acc_t(9);
  p = p * s2 + acc_t(1) / acc_t(7);
  p = p * s2 + acc_t(1) / acc_t(5);
  p = p * s2 + acc_t(1) / acc_t(3);
  p = p * s2 + acc_t(1);
  return acc_t(2) * s * p;
}

// One logit z of one-vs-all BCE, given e = exp(-|z|) (the caller's exp: exact or fast):
//   absent entry (t = 0):  loss softplus(z) = max(z, 0) + log1p(e),   dloss/dz = sigmoid(z)
//   entry (t, lw = 1 + (pos_weight - 1) t):
//       loss (1 - t) z + lw softplus(-z),   dloss/dz = (1 - t) - lw sigmoid(-z)
// (F.binary_cross_entropy_with_logits' formula; sigmoid(-z) directly, so t = 1 has no 1 - sigmoid(z)
// cancellation.)
template <typename acc_t>
C10_HOST_DEVICE inline acc_t bce_absent_loss(acc_t z, acc_t e) {
  return (z > acc_t(0) ? z : acc_t(0)) + log1p_unit(e);
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t bce_absent_grad(acc_t z, acc_t e) {
  const acc_t r = div_small(acc_t(1), acc_t(1) + e);
  return z >= acc_t(0) ? r : e * r;  // sigmoid(z) without overflow for either sign
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t bce_entry_loss(acc_t z, acc_t e, acc_t t, acc_t lw) {
  return (acc_t(1) - t) * z + lw * ((z < acc_t(0) ? -z : acc_t(0)) + log1p_unit(e));
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t bce_entry_grad(acc_t z, acc_t e, acc_t t, acc_t lw) {
  const acc_t r = div_small(acc_t(1), acc_t(1) + e);
  const acc_t sig_neg = z >= acc_t(0) ? e * r : r;  // sigmoid(-z)
  return (acc_t(1) - t) - lw * sig_neg;
}

#ifndef __CUDACC_RTC__
// Checks of a CSR target against R = logits.size(0) rows (both backends). The structure itself (sorted,
// in-range columns) is validated in Python before any kernel runs (hugehead/sparse.py); here only what
// the kernel's memory safety needs cheaply: dtypes, devices, contiguity and sizes.
inline void check_csr_target(const at::Tensor& logits, const at::Tensor& crow, const at::Tensor& col,
                             const at::Tensor& val) {
  TORCH_CHECK(crow.dim() == 1 && crow.size(0) == logits.size(0) + 1, "hugehead: crow must have shape [",
              logits.size(0) + 1, "], got ", crow.sizes());
  TORCH_CHECK(col.dim() == 1 && val.dim() == 1 && col.size(0) == val.size(0),
              "hugehead: col and val must be 1-D of one length, got ", col.sizes(), " and ", val.sizes());
  TORCH_CHECK(crow.scalar_type() == at::kLong && col.scalar_type() == at::kLong,
              "hugehead: crow and col must be int64, got ", crow.scalar_type(), " and ", col.scalar_type());
  const auto acc = acc_type_for(logits.scalar_type());
  TORCH_CHECK(val.scalar_type() == acc, "hugehead: val must be ", acc, " for ", logits.scalar_type(),
              " logits, got ", val.scalar_type());
  for (const at::Tensor* t : {&crow, &col, &val}) {
    TORCH_CHECK(t->device() == logits.device(), "hugehead: the CSR target is on ", t->device(),
                " but logits are on ", logits.device());
    TORCH_CHECK(t->is_contiguous(), "hugehead: crow, col and val must be contiguous");
  }
}

// An optional [C] per-class vector of the chunk (class_weight) in the accumulation dtype.
inline void check_chunk_classes(const at::Tensor& logits, const at::Tensor& t, const char* name) {
  const auto acc = acc_type_for(logits.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == logits.size(1), "hugehead: ", name, " must have shape [",
              logits.size(1), "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == acc, "hugehead: ", name, " must be ", acc, ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == logits.device(), "hugehead: ", name, " is on ", t.device(), " but logits are on ",
              logits.device());
  TORCH_CHECK(t.is_contiguous(), "hugehead: ", name, " must be contiguous");
}
#endif

}  // namespace hugehead
