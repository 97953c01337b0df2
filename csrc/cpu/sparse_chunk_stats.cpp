// CPU kernel of hugehead::sparse_chunk_stats_: fold a logits chunk into running per-row log-sum-exp
// stats and the dot product of each row's sparse target entries (those in the chunk) with its logits.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/numerics.h"
#include "hugehead/sparse_target.h"

#include <type_traits>

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t>
void sparse_chunk_stats_rows(const SparseChunkStatsParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  auto* row_max = static_cast<acc_t*>(p.row_max);
  auto* row_sumexp = static_cast<acc_t*>(p.row_sumexp);
  auto* target_dot = static_cast<acc_t*>(p.target_dot);
  auto* logit_sum = static_cast<acc_t*>(p.logit_sum);
  const auto* val = static_cast<const acc_t*>(p.target.val);
  const auto* weight = static_cast<const acc_t*>(p.class_weight);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    acc_t m, s, sum;
    bool done = false;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (softcap <= acc_t(0) && weight == nullptr) {  // the common case, vectorized
        cpu::row_stats_f32(z, p.cols, m, s, sum);
        done = true;
      }
    }
    if (!done) {  // two passes over the row (it sits in cache): the max, then the shifted sums
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
    lse_merge(row_max[row], row_sumexp[row], m, s);
    logit_sum[row] += sum;
    const EntryRange entries = chunk_entries(p.target.crow, p.target.col, row, p.class_start, p.cols);
    acc_t dot = 0;
    for (int64_t e = entries.begin; e < entries.end; ++e) {
      dot += val[e] * apply_softcap(static_cast<acc_t>(z[p.target.col[e] - p.class_start]), softcap);
    }
    if (entries.end > entries.begin) target_dot[row] += dot;
  }
}

void sparse_chunk_stats_cpu(const at::Tensor& logits_in, const at::Tensor& crow, const at::Tensor& col,
                            const at::Tensor& val, int64_t class_start, double softcap,
                            const std::optional<at::Tensor>& class_weight, const at::Tensor& row_max,
                            const at::Tensor& row_sumexp, const at::Tensor& target_dot,
                            const at::Tensor& logit_sum) {
  const at::Tensor logits = logits_in.dim() == 2 && logits_in.size(1) > 1 && logits_in.stride(1) != 1
                                ? logits_in.contiguous()
                                : logits_in;
  check_logits_chunk(logits);
  check_csr_target(logits, crow, col, val);
  check_row_vectors(logits, {{"row_max", &row_max}, {"row_sumexp", &row_sumexp}, {"target_dot", &target_dot},
                             {"logit_sum", &logit_sum}});
  if (class_weight.has_value()) check_chunk_classes(logits, *class_weight, "class_weight");
  SparseChunkStatsParams p{logits.data_ptr(),
                           {crow.data_ptr<int64_t>(), col.data_ptr<int64_t>(), val.data_ptr()},
                           class_weight.has_value() ? class_weight->data_ptr() : nullptr,
                           row_max.data_ptr(), row_sumexp.data_ptr(), target_dot.data_ptr(),
                           logit_sum.data_ptr(), logits.size(0), logits.size(1), logits.stride(0),
                           class_start, softcap};
  if (p.rows == 0 || p.cols == 0) return;
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "sparse_chunk_stats_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.cols));
    at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
      sparse_chunk_stats_rows<scalar_t, acc_t>(p, begin, end);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("sparse_chunk_stats_", &sparse_chunk_stats_cpu); }

}  // namespace hugehead
