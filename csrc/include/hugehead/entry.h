// The host entry of every op, written once for both backends: the argument checks, the params struct
// the kernels get, and the early return of an empty chunk. A backend's file supplies only how the params
// are run (a Launch: dtype dispatch and kernel launch) and registers the entry with it, e.g.
//   TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_stats_", &entry::chunk_stats<chunk_stats_cpu>); }
// The argument lists follow the schemas in hugehead.cpp. What only one backend needs (the CUDA grid's row
// limit, the device guard) is checked there, still before any kernel runs.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/mul.h>

#include <cstdint>
#include <optional>

#include "hugehead/common.h"
#include "hugehead/sparse_target.h"
#include "hugehead/topk.h"

namespace hugehead {
namespace entry {

// Runs checked params on a backend; logits is the chunk they point into (for its dtype and device).
template <typename Params>
using Launch = void (*)(const Params& p, const at::Tensor& logits);

// An optional tensor's data, or nullptr for none (the params' "absent" marker).
inline void* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

template <Launch<ChunkStatsParams> launch>
void chunk_stats(const at::Tensor& logits_in, const at::Tensor& target, int64_t class_start, double softcap,
                 const at::Tensor& row_max, const at::Tensor& row_sumexp, const at::Tensor& target_logit,
                 const at::Tensor& logit_sum) {
  const at::Tensor logits = with_unit_column_stride(logits_in);
  check_chunk_rows(logits, target,
                   {{"row_max", &row_max}, {"row_sumexp", &row_sumexp}, {"target_logit", &target_logit},
                    {"logit_sum", &logit_sum}});
  const ChunkStatsParams p{logits.data_ptr(), target.data_ptr<int64_t>(), row_max.data_ptr(),
                           row_sumexp.data_ptr(), target_logit.data_ptr(), logit_sum.data_ptr(),
                           logits.size(0), logits.size(1), logits.stride(0), class_start, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

template <Launch<ChunkGradParams> launch>
void chunk_grad(const at::Tensor& logits, const at::Tensor& target, int64_t class_start, int64_t num_classes,
                const at::Tensor& lse, const at::Tensor& grad_rows, double label_smoothing, double z_loss,
                double softcap, const std::optional<at::Tensor>& grad_lse) {
  check_chunk_rows(logits, target, {{"lse", &lse}, {"grad_rows", &grad_rows}});
  if (grad_lse.has_value()) check_row_vectors(logits, {{"grad_lse", &*grad_lse}});
  TORCH_CHECK(num_classes > 0, "hugehead: num_classes must be positive, got ", num_classes);
  const ChunkGradParams p{logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr(), grad_rows.data_ptr(),
                          data_or_null(grad_lse), logits.size(0), logits.size(1), logits.stride(0),
                          class_start, num_classes, label_smoothing, z_loss, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

template <Launch<EntropyGradParams> launch>
void entropy_chunk_grad(const at::Tensor& logits, const at::Tensor& target, int64_t class_start, double softcap,
                        const at::Tensor& lse, const at::Tensor& grad_rows, const at::Tensor& grad_entropy,
                        const at::Tensor& entropy) {
  check_chunk_rows(logits, target,
                   {{"lse", &lse}, {"grad_rows", &grad_rows}, {"grad_entropy", &grad_entropy},
                    {"entropy", &entropy}});
  const EntropyGradParams p{logits.data_ptr(), target.data_ptr<int64_t>(), lse.data_ptr(), grad_rows.data_ptr(),
                            grad_entropy.data_ptr(), entropy.data_ptr(), logits.size(0), logits.size(1),
                            logits.stride(0), class_start, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

// The teacher chunk of distillation (unit column stride by now): the student chunk's shape and device, in the
// student's dtype or its accumulation dtype (true), never sharing memory with the student chunk.
inline bool check_teacher_chunk(const at::Tensor& logits, const at::Tensor& teacher, int64_t divergence,
                                double beta) {
  TORCH_CHECK(divergence >= 0 && divergence <= 2, "hugehead: divergence must be 0 (forward KL), 1 (reverse KL) or ",
              "2 (JSD), got ", divergence);
  TORCH_CHECK(divergence != 2 || (beta > 0 && beta < 1), "hugehead: the JSD's beta must be in (0, 1), got ", beta);
  TORCH_CHECK(teacher.sizes() == logits.sizes(), "hugehead: teacher must have the logits' shape ", logits.sizes(),
              ", got ", teacher.sizes());
  HUGEHEAD_CHECK_DEVICE(teacher, logits);
  const auto acc = acc_type_for(logits.scalar_type());
  TORCH_CHECK(teacher.scalar_type() == logits.scalar_type() || teacher.scalar_type() == acc, "hugehead: teacher ",
              "must be ", logits.scalar_type(), acc == logits.scalar_type() ? "" : " or its accumulation dtype",
              " like the ", logits.scalar_type(), " logits, got ", teacher.scalar_type());
  TORCH_CHECK(!teacher.is_alias_of(logits), "hugehead: teacher must not share memory with the logits");
  return teacher.scalar_type() != logits.scalar_type();
}

template <Launch<DistillStatsParams> launch>
void distill_chunk_stats(const at::Tensor& logits_in, const at::Tensor& teacher_in, int64_t divergence, double beta,
                         double softcap, double teacher_softcap, const std::optional<at::Tensor>& teacher_lse,
                         const std::optional<at::Tensor>& student_lse, const at::Tensor& row_max,
                         const at::Tensor& row_sumexp, const at::Tensor& logit_sum, const at::Tensor& target_logit) {
  const at::Tensor logits = with_unit_column_stride(logits_in);
  const at::Tensor teacher = with_unit_column_stride(teacher_in);
  check_logits_chunk(logits);
  const bool teacher_is_acc = check_teacher_chunk(logits, teacher, divergence, beta);
  check_row_vectors(logits, {{"row_max", &row_max}, {"row_sumexp", &row_sumexp}, {"logit_sum", &logit_sum},
                             {"target_logit", &target_logit}});
  TORCH_CHECK(divergence != 2 || (teacher_lse.has_value() && student_lse.has_value()),
              "hugehead: the JSD needs teacher_lse and student_lse");
  if (teacher_lse.has_value()) check_row_vectors(logits, {{"teacher_lse", &*teacher_lse}});
  if (student_lse.has_value()) check_row_vectors(logits, {{"student_lse", &*student_lse}});
  const DistillStatsParams p{logits.data_ptr(), teacher.data_ptr(), data_or_null(teacher_lse),
                             data_or_null(student_lse), row_max.data_ptr(), row_sumexp.data_ptr(),
                             logit_sum.data_ptr(), target_logit.data_ptr(), logits.size(0), logits.size(1),
                             logits.stride(0), teacher.stride(0), divergence, teacher_is_acc, beta, softcap,
                             teacher_softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

template <Launch<DistillGradParams> launch>
void distill_chunk_grad(const at::Tensor& logits, const at::Tensor& teacher_in, int64_t divergence, double beta,
                        double softcap, double teacher_softcap, const at::Tensor& lse, const at::Tensor& teacher_lse,
                        const std::optional<at::Tensor>& coef, const at::Tensor& grad_rows) {
  check_logits_chunk(logits);
  const at::Tensor teacher = with_unit_column_stride(teacher_in);
  const bool teacher_is_acc = check_teacher_chunk(logits, teacher, divergence, beta);
  check_row_vectors(logits, {{"lse", &lse}, {"teacher_lse", &teacher_lse}, {"grad_rows", &grad_rows}});
  TORCH_CHECK(divergence == 0 || coef.has_value(), "hugehead: reverse KL and the JSD need coef");
  if (coef.has_value()) check_row_vectors(logits, {{"coef", &*coef}});
  const DistillGradParams p{logits.data_ptr(), teacher.data_ptr(), lse.data_ptr(), teacher_lse.data_ptr(),
                            data_or_null(coef), grad_rows.data_ptr(), logits.size(0), logits.size(1),
                            logits.stride(0), teacher.stride(0), divergence, teacher_is_acc, beta, softcap,
                            teacher_softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

template <Launch<ChunkTopkParams> launch>
void chunk_topk(const at::Tensor& logits_in, const std::optional<at::Tensor>& bias, int64_t class_start,
                double softcap, const at::Tensor& values, const at::Tensor& indices) {
  const at::Tensor logits = with_unit_column_stride(logits_in);
  check_chunk_topk(logits, bias, values, indices, class_start);
  const ChunkTopkParams p{logits.data_ptr(), data_or_null(bias), values.data_ptr(), indices.data_ptr<int64_t>(),
                          logits.size(0), logits.size(1), logits.stride(0), values.size(1), class_start, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

inline CsrTarget csr_target(const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val) {
  return {crow.data_ptr<int64_t>(), col.data_ptr<int64_t>(), val.data_ptr()};
}

template <Launch<SparseChunkStatsParams> launch>
void sparse_chunk_stats(const at::Tensor& logits_in, const at::Tensor& crow, const at::Tensor& col,
                        const at::Tensor& val, int64_t class_start, double softcap,
                        const std::optional<at::Tensor>& class_weight, const at::Tensor& row_max,
                        const at::Tensor& row_sumexp, const at::Tensor& target_dot, const at::Tensor& logit_sum) {
  const at::Tensor logits = with_unit_column_stride(logits_in);
  check_logits_chunk(logits);
  check_csr_target(logits, crow, col, val);
  check_row_vectors(logits, {{"row_max", &row_max}, {"row_sumexp", &row_sumexp}, {"target_dot", &target_dot},
                             {"logit_sum", &logit_sum}});
  if (class_weight.has_value()) check_chunk_classes(logits, *class_weight, "class_weight");
  const SparseChunkStatsParams p{logits.data_ptr(), csr_target(crow, col, val), data_or_null(class_weight),
                                 row_max.data_ptr(), row_sumexp.data_ptr(), target_dot.data_ptr(),
                                 logit_sum.data_ptr(), logits.size(0), logits.size(1), logits.stride(0),
                                 class_start, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

template <Launch<SparseChunkGradParams> launch>
void sparse_chunk_grad(const at::Tensor& logits, const at::Tensor& crow, const at::Tensor& col,
                       const at::Tensor& val, int64_t class_start, int64_t num_classes, const at::Tensor& lse,
                       const at::Tensor& grad_rows, const at::Tensor& target_mass, double label_smoothing,
                       double z_loss, double softcap, const std::optional<at::Tensor>& class_weight,
                       const std::optional<at::Tensor>& grad_lse) {
  check_logits_chunk(logits);
  check_csr_target(logits, crow, col, val);
  check_row_vectors(logits, {{"lse", &lse}, {"grad_rows", &grad_rows}, {"target_mass", &target_mass}});
  if (grad_lse.has_value()) check_row_vectors(logits, {{"grad_lse", &*grad_lse}});
  if (class_weight.has_value()) check_chunk_classes(logits, *class_weight, "class_weight");
  TORCH_CHECK(num_classes > 0, "hugehead: num_classes must be positive, got ", num_classes);
  const SparseChunkGradParams p{logits.data_ptr(), csr_target(crow, col, val), data_or_null(class_weight),
                                lse.data_ptr(), grad_rows.data_ptr(), target_mass.data_ptr(),
                                data_or_null(grad_lse), logits.size(0), logits.size(1), logits.stride(0),
                                class_start, num_classes, label_smoothing, z_loss, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  launch(p, logits);
}

template <Launch<BceChunkParams> launch>
void bce_chunk(const at::Tensor& logits, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
               const std::optional<at::Tensor>& entry_weight, int64_t class_start,
               const std::optional<at::Tensor>& row_loss, const std::optional<at::Tensor>& grad_rows) {
  check_logits_chunk(logits);
  check_csr_target(logits, crow, col, val);
  if (row_loss.has_value()) check_row_vectors(logits, {{"row_loss", &*row_loss}});
  if (grad_rows.has_value()) check_row_vectors(logits, {{"grad_rows", &*grad_rows}});
  if (entry_weight.has_value()) {
    TORCH_CHECK(entry_weight->sizes() == val.sizes() && entry_weight->scalar_type() == val.scalar_type() &&
                    entry_weight->device() == val.device() && entry_weight->is_contiguous(),
                "hugehead: entry_weight must be a contiguous ", val.scalar_type(), " tensor shaped like val ",
                val.sizes(), ", got ", entry_weight->scalar_type(), " ", entry_weight->sizes());
  }
  const BceChunkParams p{logits.data_ptr(), csr_target(crow, col, val), data_or_null(entry_weight),
                         data_or_null(row_loss), data_or_null(grad_rows), logits.size(0), logits.size(1),
                         logits.stride(0), class_start};
  if (p.rows == 0 || p.cols == 0 || (p.row_loss == nullptr && p.grad_rows == nullptr)) return;
  launch(p, logits);
}

// scale_: the checks, and the layouts no kernel takes (a strided view with gaps) through ATen with the same
// arithmetic: the product in float32 (float64 for float64 self) with the whole scale, rounded once. ATen's
// mul_ gives that for float32/float64 self on either backend, but on CUDA it rounds a float32 0-d scale to a
// 16-bit self's dtype first, so 16-bit self goes through a float32 copy there.
template <Launch<ScaleParams> launch>
void scale(const at::Tensor& self, const at::Tensor& scale) {
  const auto dtype = self.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
              "hugehead: scale_ takes a float16, bfloat16, float32 or float64 self, got ", dtype);
  TORCH_CHECK(scale.numel() == 1, "hugehead: scale_'s scale must be a 0-d (one-element) tensor, got shape ",
              scale.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kDouble,
              "hugehead: scale_'s scale must be float32 or float64, got ", scale.scalar_type());
  TORCH_CHECK(scale.device() == self.device(), "hugehead: scale_'s scale is on ", scale.device(),
              " but self is on ", self.device(), " (it is read on self's device)");
  TORCH_CHECK(at::has_internal_overlap(self) != at::MemOverlap::Yes,
              "hugehead: scale_ cannot write self in place: some of its elements share memory (an expanded view)");
  TORCH_CHECK(!scale.is_alias_of(self), "hugehead: scale_'s scale must not share memory with self");
  if (self.numel() == 0) return;
  if (self.is_non_overlapping_and_dense()) {
    launch(ScaleParams{self.data_ptr(), scale.const_data_ptr(), self.numel(), scale.scalar_type() == at::kDouble},
           self);
  } else if (self.is_cuda() && (dtype == at::kHalf || dtype == at::kBFloat16)) {
    self.copy_(self.to(at::kFloat).mul_(scale.reshape({})));
  } else {
    self.mul_(scale.reshape({}));
  }
}

// row_scale: the checks, and the layouts no kernel takes (a column stride other than 1) through ATen's mul with
// the same arithmetic (the product in the accumulation dtype, rounded once to out's dtype).
template <Launch<RowScaleParams> launch>
void row_scale(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
              "hugehead: row_scale takes a float16, bfloat16, float32 or float64 x, got ", dtype);
  HUGEHEAD_CHECK_DIM(x, 2);
  TORCH_CHECK(out.scalar_type() == dtype && out.sizes() == x.sizes(), "hugehead: row_scale's out must be ", dtype,
              " shaped like x ", x.sizes(), ", got ", out.scalar_type(), " ", out.sizes());
  const auto acc = acc_type_for(dtype);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == x.size(0), "hugehead: row_scale's scale must have shape [",
              x.size(0), "], got ", scale.sizes());
  TORCH_CHECK(scale.scalar_type() == acc, "hugehead: row_scale's scale must be ", acc, " for ", dtype,
              " x, got ", scale.scalar_type());
  TORCH_CHECK(out.device() == x.device() && scale.device() == x.device(), "hugehead: row_scale's out (",
              out.device(), ") and scale (", scale.device(), ") must be on x's device ", x.device());
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes,
              "hugehead: row_scale cannot write out: some of its elements share memory (an expanded view)");
  TORCH_CHECK(!out.is_alias_of(scale), "hugehead: row_scale's out must not share memory with scale");
  if (out.is_alias_of(x)) {
    TORCH_CHECK(out.data_ptr() == x.data_ptr() && out.strides() == x.strides(),
                "hugehead: row_scale's out overlaps x without being x itself (in place)");
  }
  if (x.numel() == 0) return;
  if (x.stride(1) == 1 && out.stride(1) == 1 && scale.is_contiguous()) {
    launch(RowScaleParams{out.data_ptr(), x.const_data_ptr(), scale.const_data_ptr(), x.size(0), x.size(1),
                          out.stride(0), x.stride(0)},
           out);
  } else {
    at::mul_out(const_cast<at::Tensor&>(out), x, scale.unsqueeze(1));
  }
}

}  // namespace entry
}  // namespace hugehead
