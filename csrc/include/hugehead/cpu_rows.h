// The row loops the CPU kernels share: blocks of rows on ATen's thread pool, a row's log-sum-exp stats
// (chunk_stats_, sparse_chunk_stats_) and the per-row frame of a chunk's gradient (chunk_grad_,
// sparse_chunk_grad_).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/numerics.h"

namespace hugehead {
namespace cpu {

// Runs rows(p, begin, end) over blocks of p's rows on ATen's thread pool, each block reading ~64k logits
// (p: any params struct with rows and cols).
template <typename Params>
void parallel_rows(const Params& p, void (*rows)(const Params&, int64_t, int64_t)) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.cols));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { rows(p, begin, end); });
}

// The launch of a CPU kernel written as ROWS<scalar_t, acc_t>(p, begin, end): defines
// void NAME(const PARAMS& p, const at::Tensor& logits), which picks scalar_t by the logits' dtype (acc_t its
// accumulation type) and runs it with parallel_rows. A macro because C++ cannot pass a function template.
#define HUGEHEAD_CPU_ROWS_LAUNCH(NAME, PARAMS, ROWS)                                 \
  void NAME(const PARAMS& p, const at::Tensor& logits) {                              \
    HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), #NAME, [&] {                       \
      ::hugehead::cpu::parallel_rows(p, ROWS<scalar_t, at::opmath_type<scalar_t>>);   \
    });                                                                               \
  }

// Folds row `row` (logits z) into p's running row_max, row_sumexp and logit_sum (+= sum_j w_j v_j, v the
// softcapped logits, w the chunk's class weights or nullptr for all 1). Float32 without softcap or weights
// takes the vectorized loop; the rest two passes over the row (it sits in cache): the max, then the shifted
// sum, one exp per element.
template <typename acc_t, typename scalar_t, typename Params>
void fold_row_stats(const Params& p, int64_t row, const scalar_t* z, const acc_t* weight) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  acc_t m, s, sum;
  bool done = false;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (softcap <= acc_t(0) && weight == nullptr) {  // the common case
      row_stats_f32(z, p.cols, m, s, sum);
      done = true;
    }
  }
  if (!done) {
    m = neg_inf<acc_t>();
    bool has_nan = false;
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t v = apply_softcap(static_cast<acc_t>(z[j]), softcap);
      has_nan |= (v != v);
      m = v > m ? v : m;
    }
    s = 0;
    sum = 0;
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t v = apply_softcap(static_cast<acc_t>(z[j]), softcap);
      s += exp_shifted(v, m);
      sum += weight == nullptr ? v : weight[j] * v;
    }
    if (has_nan) s = std::numeric_limits<acc_t>::quiet_NaN();
  }
  lse_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row], m, s);
  static_cast<acc_t*>(p.logit_sum)[row] += sum;
}

// Rows [begin, end) of a class-id statistics kernel (chunk_stats_, entropy_chunk_stats_): fold(row, z) folds the
// row's logits z into p's running statistics; the target's softcapped logit is set where it falls in the chunk.
template <typename scalar_t, typename acc_t, typename Fold>
void class_id_stats_rows(const ChunkStatsParams& p, int64_t begin, int64_t end, Fold&& fold) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  auto* target_logit = static_cast<acc_t*>(p.target_logit);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    fold(row, z);
    const int64_t t = p.target[row] - p.class_start;
    if (t >= 0 && t < p.cols) target_logit[row] = apply_softcap(static_cast<acc_t>(z[t]), softcap);
  }
}

// What every element of a row's gradient shares.
template <typename acc_t>
struct RowGrad {
  acc_t g;       // dL/dloss_row
  acc_t g_lse;   // dL/dlse of a returned lse, 0 without one
  acc_t lse;
  acc_t z_term;  // 2 z_loss lse
};

// Calls row_grad(row, z, RowGrad) for each row of [begin, end) that has a gradient, z its logits to turn
// into the gradient in place; a row without one (g = g_lse = 0: ignored rows) becomes exact zeros, whatever
// its logits hold.
template <typename scalar_t, typename acc_t, typename Params, typename F>
void for_each_grad_row(const Params& p, int64_t begin, int64_t end, F&& row_grad) {
  const auto* lse = static_cast<const acc_t*>(p.lse);
  const auto* grad_rows = static_cast<const acc_t*>(p.grad_rows);
  const auto* grad_lse = static_cast<const acc_t*>(p.grad_lse);
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* z = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
    const acc_t g = grad_rows[row];
    const acc_t gl = grad_lse == nullptr ? acc_t(0) : grad_lse[row];
    if (g == acc_t(0) && gl == acc_t(0)) {
      std::fill(z, z + p.cols, scalar_t(0));
      continue;
    }
    const acc_t l = lse[row];
    row_grad(row, z, RowGrad<acc_t>{g, gl, l, acc_t(2) * static_cast<acc_t>(p.z_loss) * l});
  }
}

}  // namespace cpu
}  // namespace hugehead
