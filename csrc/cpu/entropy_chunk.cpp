// CPU kernels of hugehead::entropy_chunk_stats_ and entropy_chunk_grad_: the log-probability loss with the
// entropy of each row's softmax (one more running sum beside the log-sum-exp; its term in the gradient).
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

namespace hugehead {
namespace {

// Two passes over a row (it sits in cache): the chunk's max, then its sum of exps and shifted sum against it,
// merged into the running triple (the shifted sum in logit_sum's slot).
template <typename scalar_t, typename acc_t>
void fold_row_entropy(const EntropyStatsParams& p, int64_t row, const scalar_t* z) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  acc_t* merged[3] = {static_cast<acc_t*>(p.row_max) + row, static_cast<acc_t*>(p.row_sumexp) + row,
                      static_cast<acc_t*>(p.logit_sum) + row};
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (softcap <= acc_t(0)) {  // the common case, vectorized
      float m, s, a;
      cpu::row_entropy_stats_f32(z, p.cols, m, s, a);
      entropy_merge(*merged[0], *merged[1], *merged[2], m, s, a);
      return;
    }
  }
  acc_t m = neg_inf<acc_t>();
  bool has_nan = false;
  for (int64_t j = 0; j < p.cols; ++j) {
    const acc_t v = apply_softcap(static_cast<acc_t>(z[j]), softcap);
    has_nan |= (v != v);
    m = v > m ? v : m;
  }
  acc_t s = 0, a = 0;
  if (m != neg_inf<acc_t>()) {
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t v = apply_softcap(static_cast<acc_t>(z[j]), softcap);
      if (v == neg_inf<acc_t>()) continue;  // exp(-inf) (-inf) counts as 0
      const acc_t e = std::exp(v - m);
      s += e;
      a += e * (v - m);
    }
  }
  if (has_nan) s = a = std::numeric_limits<acc_t>::quiet_NaN();
  entropy_merge(*merged[0], *merged[1], *merged[2], m, s, a);
}

template <typename scalar_t, typename acc_t>
void entropy_stats_rows(const EntropyStatsParams& p, int64_t begin, int64_t end) {
  cpu::class_id_stats_rows<scalar_t, acc_t>(
      p, begin, end, [&](int64_t row, const scalar_t* z) { fold_row_entropy<scalar_t, acc_t>(p, row, z); });
}

template <typename scalar_t, typename acc_t>
void entropy_grad_rows(const EntropyGradParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const auto* lse = static_cast<const acc_t*>(p.lse);
  const auto* grad_rows = static_cast<const acc_t*>(p.grad_rows);
  const auto* grad_entropy = static_cast<const acc_t*>(p.grad_entropy);
  const auto* entropy = static_cast<const acc_t*>(p.entropy);
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* z = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
    const acc_t g = grad_rows[row], ge = grad_entropy[row];
    if (g == acc_t(0) && ge == acc_t(0)) {  // ignored rows: exact zeros, whatever the logits hold
      std::fill(z, z + p.cols, scalar_t(0));
      continue;
    }
    const int64_t t = p.target[row] - p.class_start;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (softcap <= acc_t(0)) {  // the common case, vectorized
        cpu::row_entropy_grad_f32(z, p.cols, t, lse[row], g, ge, entropy[row]);
        continue;
      }
    }
    for (int64_t j = 0; j < p.cols; ++j) {
      z[j] = static_cast<scalar_t>(
          entropy_logit_grad(static_cast<acc_t>(z[j]), j == t, lse[row], g, ge, entropy[row], softcap));
    }
  }
}

HUGEHEAD_CPU_ROWS_LAUNCH(entropy_chunk_stats_cpu, EntropyStatsParams, entropy_stats_rows)
HUGEHEAD_CPU_ROWS_LAUNCH(entropy_chunk_grad_cpu, EntropyGradParams, entropy_grad_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) {
  m.impl("entropy_chunk_stats_", &entry::chunk_stats<entropy_chunk_stats_cpu>);
  m.impl("entropy_chunk_grad_", &entry::entropy_chunk_grad<entropy_chunk_grad_cpu>);
}

}  // namespace hugehead
