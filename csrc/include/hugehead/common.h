// Shared by the CPU and CUDA kernels: plain params structs (what crosses from host code to a kernel),
// argument checks with messages, and the dtype dispatch every kernel uses.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#define HUGEHEAD_CHECK_DIM(t, d) \
  TORCH_CHECK((t).dim() == (d), "hugehead: ", #t, " must have ", (d), " dims, got shape ", (t).sizes())
#define HUGEHEAD_CHECK_SIZE(t, i, n)                                                       \
  TORCH_CHECK((t).size(i) == (n), "hugehead: ", #t, ".size(", (i), ") must be ", (n), ", got ", \
              (t).size(i))
#define HUGEHEAD_CHECK_DTYPE(t, dt) \
  TORCH_CHECK((t).scalar_type() == (dt), "hugehead: ", #t, " must be ", (dt), ", got ", (t).scalar_type())
#define HUGEHEAD_CHECK_DEVICE(t, ref)                                                        \
  TORCH_CHECK((t).device() == (ref).device(), "hugehead: ", #t, " is on ", (t).device(), \
              " but ", #ref, " is on ", (ref).device())
#define HUGEHEAD_CHECK_CONTIGUOUS(t) \
  TORCH_CHECK((t).is_contiguous(), "hugehead: ", #t, " must be contiguous")

// float16 / bfloat16 / float32 logits accumulate in float32; float64 (gradcheck) in float64.
#define HUGEHEAD_DISPATCH_LOGITS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// Calls the lambda __VA_ARGS__ with constexpr bool NAME = COND: a runtime flag chosen as a kernel's template
// argument (flash-attention's BOOL_SWITCH).
#define HUGEHEAD_BOOL_SWITCH(COND, NAME, ...) \
  [&] {                                       \
    if (COND) {                               \
      constexpr static bool NAME = true;      \
      return __VA_ARGS__();                   \
    } else {                                  \
      constexpr static bool NAME = false;     \
      return __VA_ARGS__();                   \
    }                                         \
  }()

namespace hugehead {

// Fold one logits chunk [N, C] (classes class_start .. class_start+C-1) into running per-row stats.
struct ChunkStatsParams {
  const void* logits;     // [N, C], row stride row_stride elements, column stride 1
  const int64_t* target;  // [N] global class ids (anything outside the chunk is skipped)
  void* row_max;          // [N] acc_t: running max of the (softcapped) logits
  void* row_sumexp;       // [N] acc_t: running sum of exp(logit - row_max)
  void* target_logit;     // [N] acc_t: set where the target falls in this chunk
  void* logit_sum;        // [N] acc_t: running sum of logits (label smoothing)
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t class_start;
  double softcap;  // <= 0: none
};

// Turn a logits chunk [N, C] into dLoss/dlogits in place, given the final lse of every row.
struct ChunkGradParams {
  void* logits;           // [N, C] in/out, row stride row_stride, column stride 1
  const int64_t* target;  // [N]
  const void* lse;        // [N] acc_t
  const void* grad_rows;  // [N] acc_t: dL/dloss_row (0 for ignored rows)
  const void* grad_lse;   // [N] acc_t: dL/dlse of a returned lse, or nullptr for none
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t class_start;
  int64_t num_classes;  // V over all shards, for label smoothing's eps / V
  double label_smoothing;
  double z_loss;
  double softcap;  // <= 0: none
};

// The log-probability loss with the entropy of the row's softmax (hugehead.logprob) folds a chunk as chunk_stats_
// does, its logit_sum slot holding the shifted sum sum_j exp(v_j - max) (v_j - max) instead, rescaled with the max
// like sumexp, so the entropy log(sumexp) - shifted / sumexp needs no difference of large numbers.
using EntropyStatsParams = ChunkStatsParams;

// Its gradient in place: (g (p - onehot) - g_entropy p (log p + entropy)) dsoftcap/dz, p = exp(v - lse).
struct EntropyGradParams {
  void* logits;              // [N, C] in/out, row stride row_stride, column stride 1
  const int64_t* target;     // [N]
  const void* lse;           // [N] acc_t
  const void* grad_rows;     // [N] acc_t: dL/d(-log p(target)) (0 for ignored rows)
  const void* grad_entropy;  // [N] acc_t: dL/dentropy (0 for ignored rows)
  const void* entropy;       // [N] acc_t: the row's entropy over all classes
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t class_start;
  double softcap;  // <= 0: none
};

// Distillation (hugehead/distill_target.py): a student logits chunk against the teacher's logits of the same
// classes. The stats fold the student's (max, sumexp) and the divergence's per-row sums (distill.h).
struct DistillStatsParams {
  const void* logits;       // [N, C] student, row stride row_stride, column stride 1
  const void* teacher;      // [N, C] teacher, row stride teacher_stride, column stride 1; the logits' dtype
                            // (teacher_is_acc false) or their accumulation dtype (true)
  const void* teacher_lse;  // [N] acc_t: both heads' full log-sum-exps (JSD), else nullptr
  const void* student_lse;  // [N] acc_t
  void* row_max;            // [N] acc_t
  void* row_sumexp;         // [N] acc_t
  void* logit_sum;          // [N] acc_t: the divergence's running sum (distill.h: by divergence)
  void* target_logit;       // [N] acc_t: the teacher's running log-sum-exp (KLs), += sum p log(p / m) (JSD)
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t teacher_stride;
  int64_t divergence;  // distill.h's Divergence
  bool teacher_is_acc;
  double beta;             // JSD's weight of the teacher in the mixture, in (0, 1)
  double softcap;          // the student's, <= 0: none
  double teacher_softcap;  // the teacher's, <= 0: none
};

// Its gradient in place: grad_rows d divergence / d logits through the student's softcap.
struct DistillGradParams {
  void* logits;             // [N, C] in/out
  const void* teacher;      // [N, C] as in DistillStatsParams
  const void* lse;          // [N] acc_t: the student's log-sum-exp
  const void* teacher_lse;  // [N] acc_t
  const void* coef;         // [N] acc_t: sum p (s - u) (reverse KL) or (1 - beta) sum p log(p / m) (JSD), else nullptr
  const void* grad_rows;    // [N] acc_t (0: the row becomes exact zeros)
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t teacher_stride;
  int64_t divergence;
  bool teacher_is_acc;
  double beta;
  double softcap;
  double teacher_softcap;
};

// self *= scale over a tensor whose elements fill data[0, numel) (non-overlapping and dense, any order).
struct ScaleParams {
  void* data;            // numel elements of self's dtype
  const void* scale;     // one element on the same device: double when scale_is_double, else float
  int64_t numel;
  bool scale_is_double;
};

// row_scale: out[i, j] = x[i, j] * scale[i], the product in the accumulation dtype, rounded once to x's dtype.
struct RowScaleParams {
  void* out;             // rows x cols of x's dtype, row stride out_stride, unit column stride
  const void* x;         // rows x cols, row stride x_stride, unit column stride
  const void* scale;     // rows elements of the accumulation dtype (acc_type_for), contiguous
  int64_t rows, cols, out_stride, x_stride;
};

// The accumulation dtype of a logits dtype.
inline at::ScalarType acc_type_for(at::ScalarType logits) {
  return logits == at::kDouble ? at::kDouble : at::kFloat;
}

// The argument checks both backends share (the sparse targets' are in sparse_target.h, top-k's in topk.h).

// The logits chunk: 2-D floating point with unit column stride.
inline void check_logits_chunk(const at::Tensor& logits) {
  HUGEHEAD_CHECK_DIM(logits, 2);
  TORCH_CHECK(logits.size(1) <= 1 || logits.stride(1) == 1,
              "hugehead: logits chunk must have unit column stride, got strides ", logits.strides());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), "hugehead: logits must be floating point, got ",
              logits.scalar_type());
}

// A chunk the op only reads may come with any column stride (a column slice of a transposed buffer): it is
// copied once to unit column stride, which the kernels need.
inline at::Tensor with_unit_column_stride(const at::Tensor& logits) {
  return logits.dim() == 2 && logits.size(1) > 1 && logits.stride(1) != 1 ? logits.contiguous() : logits;
}

// [N] row vectors in the accumulation dtype, on the logits' device, contiguous.
inline void check_row_vectors(const at::Tensor& logits,
                              std::initializer_list<std::pair<const char*, const at::Tensor*>> row_vecs) {
  const auto acc = acc_type_for(logits.scalar_type());
  for (const auto& [name, t] : row_vecs) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0), "hugehead: ", name, " must have shape [",
                logits.size(0), "], got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == acc, "hugehead: ", name, " must be ", acc, " for ", logits.scalar_type(),
                " logits, got ", t->scalar_type());
    TORCH_CHECK(t->device() == logits.device(), "hugehead: ", name, " is on ", t->device(),
                " but logits are on ", logits.device());
    TORCH_CHECK(t->is_contiguous(), "hugehead: ", name, " must be contiguous");
  }
}

// The logits chunk, its [N] int64 target and its [N] row vectors.
inline void check_chunk_rows(const at::Tensor& logits, const at::Tensor& target,
                             std::initializer_list<std::pair<const char*, const at::Tensor*>> row_vecs) {
  check_logits_chunk(logits);
  HUGEHEAD_CHECK_DIM(target, 1);
  HUGEHEAD_CHECK_SIZE(target, 0, logits.size(0));
  HUGEHEAD_CHECK_DTYPE(target, at::kLong);
  HUGEHEAD_CHECK_DEVICE(target, logits);
  HUGEHEAD_CHECK_CONTIGUOUS(target);
  check_row_vectors(logits, row_vecs);
}

}  // namespace hugehead
