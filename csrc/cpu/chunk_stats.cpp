// CPU kernel of hugehead::chunk_stats_: fold a logits chunk into running per-row log-sum-exp stats.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

#include <type_traits>

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t>
void chunk_stats_rows(const ChunkStatsParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  auto* row_max = static_cast<acc_t*>(p.row_max);
  auto* row_sumexp = static_cast<acc_t*>(p.row_sumexp);
  auto* target_logit = static_cast<acc_t*>(p.target_logit);
  auto* logit_sum = static_cast<acc_t*>(p.logit_sum);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (softcap <= acc_t(0)) {  // the common case, vectorized
        acc_t m, s, sum;
        cpu::row_stats_f32(z, p.cols, m, s, sum);
        lse_merge(row_max[row], row_sumexp[row], m, s);
        logit_sum[row] += sum;
        const int64_t t = p.target[row] - p.class_start;
        if (t >= 0 && t < p.cols) target_logit[row] = z[t];
        continue;
      }
    }
    // Two passes over the row (it sits in cache): the max, then the shifted sum, one exp per element.
    acc_t m = neg_inf<acc_t>();
    bool has_nan = false;
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t v = apply_softcap(static_cast<acc_t>(z[j]), softcap);
      has_nan |= (v != v);
      m = v > m ? v : m;
    }
    acc_t s = 0, sum = 0;
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t v = apply_softcap(static_cast<acc_t>(z[j]), softcap);
      s += exp_shifted(v, m);
      sum += v;
    }
    if (has_nan) s = std::numeric_limits<acc_t>::quiet_NaN();
    lse_merge(row_max[row], row_sumexp[row], m, s);
    logit_sum[row] += sum;
    const int64_t t = p.target[row] - p.class_start;
    if (t >= 0 && t < p.cols) target_logit[row] = apply_softcap(static_cast<acc_t>(z[t]), softcap);
  }
}

void chunk_stats_cpu(const ChunkStatsParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_stats_cpu", [&] {
    cpu::parallel_rows(p, chunk_stats_rows<scalar_t, at::opmath_type<scalar_t>>);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_stats_", &entry::chunk_stats<chunk_stats_cpu>); }

}  // namespace hugehead
