// CPU kernel of hugehead::chunk_stats_: fold a logits chunk into running per-row log-sum-exp stats.
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t>
void chunk_stats_rows(const ChunkStatsParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  auto* target_logit = static_cast<acc_t*>(p.target_logit);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    cpu::fold_row_stats<acc_t>(p, row, z, /*weight=*/nullptr);
    const int64_t t = p.target[row] - p.class_start;
    if (t >= 0 && t < p.cols) target_logit[row] = apply_softcap(static_cast<acc_t>(z[t]), softcap);
  }
}

HUGEHEAD_CPU_ROWS_LAUNCH(chunk_stats_cpu, ChunkStatsParams, chunk_stats_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_stats_", &entry::chunk_stats<chunk_stats_cpu>); }

}  // namespace hugehead
