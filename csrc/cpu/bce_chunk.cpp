// CPU kernel of hugehead::bce_chunk_: one-vs-all binary cross-entropy of a logits chunk against a CSR
// target: the chunk's per-logit losses summed per row, and/or the chunk replaced by its gradient.
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/entry.h"
#include "hugehead/sparse_target.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace hugehead {
namespace {

// One float32 row, every logit as an absent entry (t = 0): returns the sum of softplus(z) and, when
// kGrad, writes g * sigmoid(z) in place. Arithmetic only (exp_nonpositive, log1p_unit), so it vectorizes.
template <bool kLoss, bool kGrad>
HUGEHEAD_CPU_CLONES float row_bce_absent_f32(float* z, int64_t cols, float g) {
  float loss = 0.0f;
#pragma omp simd reduction(+ : loss)
  for (int64_t j = 0; j < cols; ++j) {
    const float v = z[j];
    const float e = cpu::exp_nonpositive(-std::fabs(v));
    if constexpr (kLoss) loss += bce_absent_loss(v, e);
    if constexpr (kGrad) z[j] = g * bce_absent_grad(v, e);
  }
  return loss;
}

template <typename acc_t>
acc_t exp_of_minus_abs(acc_t z) {
  return std::exp(-std::fabs(z));
}

template <typename scalar_t, typename acc_t>
void bce_chunk_rows(const BceChunkParams& p, int64_t begin, int64_t end) {
  auto* row_loss = static_cast<acc_t*>(p.row_loss);
  const auto* grad_rows = static_cast<const acc_t*>(p.grad_rows);
  const auto* val = static_cast<const acc_t*>(p.target.val);
  const auto* entry_weight = static_cast<const acc_t*>(p.entry_weight);
  std::vector<acc_t> entry_logits;  // the entries' logits, read before the row is overwritten
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* z = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
    const bool grad = grad_rows != nullptr;
    const acc_t g = grad ? grad_rows[row] : acc_t(0);
    const EntryRange entries = chunk_entries(p.target.crow, p.target.col, row, p.class_start, p.cols);
    entry_logits.resize(static_cast<size_t>(entries.end - entries.begin));
    for (int64_t e = entries.begin; e < entries.end; ++e) {
      entry_logits[e - entries.begin] = static_cast<acc_t>(z[p.target.col[e] - p.class_start]);
    }
    acc_t loss = 0;
    bool done = false;
    if constexpr (std::is_same_v<scalar_t, float>) {  // vectorized
      if (row_loss != nullptr && grad) {
        loss = row_bce_absent_f32<true, true>(z, p.cols, g);
      } else if (row_loss != nullptr) {
        loss = row_bce_absent_f32<true, false>(z, p.cols, g);
      } else {
        row_bce_absent_f32<false, true>(z, p.cols, g);
      }
      done = true;
    }
    if (!done) {
      for (int64_t j = 0; j < p.cols; ++j) {
        const acc_t v = static_cast<acc_t>(z[j]);
        const acc_t e = exp_of_minus_abs(v);
        if (row_loss != nullptr) loss += bce_absent_loss(v, e);
        if (grad) z[j] = static_cast<scalar_t>(g * bce_absent_grad(v, e));
      }
    }
    // The entries: their loss replaces the absent-entry loss summed above, their gradient is rewritten.
    for (int64_t e = entries.begin; e < entries.end; ++e) {
      const acc_t v = entry_logits[e - entries.begin];
      const acc_t ex = exp_of_minus_abs(v);
      const acc_t lw = entry_weight == nullptr ? acc_t(1) : entry_weight[e];
      if (row_loss != nullptr) loss += bce_entry_loss(v, ex, val[e], lw) - bce_absent_loss(v, ex);
      if (grad) z[p.target.col[e] - p.class_start] = static_cast<scalar_t>(g * bce_entry_grad(v, ex, val[e], lw));
    }
    if (row_loss != nullptr) row_loss[row] += loss;
  }
}

HUGEHEAD_CPU_ROWS_LAUNCH(bce_chunk_cpu, BceChunkParams, bce_chunk_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("bce_chunk_", &entry::bce_chunk<bce_chunk_cpu>); }

}  // namespace hugehead
