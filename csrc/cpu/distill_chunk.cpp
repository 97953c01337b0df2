// CPU kernels of hugehead::distill_chunk_stats_ and distill_chunk_grad_: a student logits chunk against the
// teacher's logits of the same classes (distill.h holds the math). Rows in parallel; within a row two passes
// for the statistics (the chunk's maxima, then its sums against them), one for the gradient.
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/distill.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

namespace hugehead {
namespace {

// Row `row` of the teacher chunk in acc_t, stored in the student's dtype or in acc_t.
template <typename scalar_t, typename acc_t>
struct TeacherRow {
  const scalar_t* low = nullptr;
  const acc_t* acc = nullptr;
  template <typename Params>
  TeacherRow(const Params& p, int64_t row) {
    if (p.teacher_is_acc) {
      acc = static_cast<const acc_t*>(p.teacher) + row * p.teacher_stride;
    } else {
      low = static_cast<const scalar_t*>(p.teacher) + row * p.teacher_stride;
    }
  }
  acc_t operator[](int64_t j) const { return acc != nullptr ? acc[j] : static_cast<acc_t>(low[j]); }
};

// The two KLs fold a chunk against its own maxima (distill.h): the student's (max, sum of exps) and, for reverse
// KL, sum exp(s - max) (s - u) into (row_max, row_sumexp, logit_sum); the teacher's log-sum-exp into target_logit
// and, for forward KL, the mean of (u - s) under the teacher's softmax into logit_sum. JSD sums its terms against
// both log-sum-exps given.
template <typename scalar_t, typename acc_t>
void distill_stats_rows(const DistillStatsParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  const auto div = static_cast<Divergence>(p.divergence);
  const auto* teacher_lse = static_cast<const acc_t*>(p.teacher_lse);
  const auto* student_lse = static_cast<const acc_t*>(p.student_lse);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    const TeacherRow<scalar_t, acc_t> t(p, row);
    auto student = [&](int64_t j) { return apply_softcap(static_cast<acc_t>(z[j]), softcap); };
    auto teacher = [&](int64_t j) { return apply_softcap(t[j], teacher_softcap); };
    acc_t m = neg_inf<acc_t>(), mt = neg_inf<acc_t>();
    bool has_nan = false;
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t s = student(j), u = teacher(j);
      has_nan |= (s != s) || (u != u);
      m = s > m ? s : m;
      mt = u > mt ? u : mt;
    }
    // The chunk's sums in double for float32 rows: a row of many classes sums terms of both signs (cancelling),
    // and a long float32 running sum would lose what the float64 reference keeps.
    using sum_t = std::conditional_t<std::is_same_v<acc_t, float>, double, acc_t>;
    sum_t se = 0, st = 0, a = 0, part = 0;  // a: the weighted sum (or JSD's sum)
    const DistillRow<acc_t> r = distill_row<acc_t>(p, teacher_lse == nullptr ? acc_t(0) : teacher_lse[row],
                                                   student_lse == nullptr ? acc_t(0) : student_lse[row]);
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t s = student(j), u = teacher(j);
      const acc_t e = exp_shifted(s, m), et = exp_shifted(u, mt);
      se += e;
      st += et;
      if (div == Divergence::kForwardKL) {
        a += prob_times(et, u - s);
      } else if (div == Divergence::kReverseKL) {
        a += prob_times(e, s - u);
      } else {
        acc_t sum = 0, b = 0;
        jsd_terms(s, u, r, sum, b);
        a += sum;
        part += b;
      }
    }
    if (has_nan) se = st = a = std::numeric_limits<sum_t>::quiet_NaN();
    auto& row_max = static_cast<acc_t*>(p.row_max)[row];
    auto& row_sumexp = static_cast<acc_t*>(p.row_sumexp)[row];
    auto& logit_sum = static_cast<acc_t*>(p.logit_sum)[row];
    auto& target_logit = static_cast<acc_t*>(p.target_logit)[row];
    if (div == Divergence::kJSD) {
      lse_merge(row_max, row_sumexp, m, static_cast<acc_t>(se));
      logit_sum += static_cast<acc_t>(a);
      target_logit += static_cast<acc_t>(part);
      continue;
    }
    acc_t lse_t, mean_t;
    lse_and_mean(mt, st, a, lse_t, mean_t);
    if (div == Divergence::kForwardKL) {
      lse_merge(row_max, row_sumexp, m, static_cast<acc_t>(se));
      lse_mean_merge(target_logit, logit_sum, lse_t, mean_t);
    } else {
      scaled_merge(row_max, row_sumexp, logit_sum, m, static_cast<acc_t>(se), static_cast<acc_t>(a));
      target_logit = log_add_exp(target_logit, lse_t);
    }
  }
}

template <typename scalar_t, typename acc_t>
void distill_grad_rows(const DistillGradParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  const auto div = static_cast<Divergence>(p.divergence);
  const auto* lse = static_cast<const acc_t*>(p.lse);
  const auto* teacher_lse = static_cast<const acc_t*>(p.teacher_lse);
  const auto* coef = static_cast<const acc_t*>(p.coef);
  const auto* grad_rows = static_cast<const acc_t*>(p.grad_rows);
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* z = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
    const acc_t g = grad_rows[row];
    if (g == acc_t(0)) {  // masked rows: exact zeros, whatever the logits hold
      std::fill(z, z + p.cols, scalar_t(0));
      continue;
    }
    const TeacherRow<scalar_t, acc_t> t(p, row);
    const DistillRow<acc_t> r = distill_row<acc_t>(p, teacher_lse[row], lse[row]);
    const acc_t c = coef == nullptr ? acc_t(0) : coef[row];
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t u = apply_softcap(static_cast<acc_t>(t[j]), teacher_softcap);
      z[j] = static_cast<scalar_t>(distill_logit_grad(div, static_cast<acc_t>(z[j]), u, r, c, g, softcap));
    }
  }
}

HUGEHEAD_CPU_ROWS_LAUNCH(distill_chunk_stats_cpu, DistillStatsParams, distill_stats_rows)
HUGEHEAD_CPU_ROWS_LAUNCH(distill_chunk_grad_cpu, DistillGradParams, distill_grad_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) {
  m.impl("distill_chunk_stats_", &entry::distill_chunk_stats<distill_chunk_stats_cpu>);
  m.impl("distill_chunk_grad_", &entry::distill_chunk_grad<distill_chunk_grad_cpu>);
}

}  // namespace hugehead
