// CPU kernel of hugehead::sparse_chunk_stats_: fold a logits chunk into running per-row log-sum-exp
// stats and the dot product of each row's sparse target entries (those in the chunk) with its logits.
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"
#include "hugehead/sparse_target.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t>
void sparse_chunk_stats_rows(const SparseChunkStatsParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  auto* target_dot = static_cast<acc_t*>(p.target_dot);
  const auto* val = static_cast<const acc_t*>(p.target.val);
  const auto* weight = static_cast<const acc_t*>(p.class_weight);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    cpu::fold_row_stats<acc_t>(p, row, z, weight);
    const EntryRange entries = chunk_entries(p.target.crow, p.target.col, row, p.class_start, p.cols);
    acc_t dot = 0;
    for (int64_t e = entries.begin; e < entries.end; ++e) {
      dot += val[e] * apply_softcap(static_cast<acc_t>(z[p.target.col[e] - p.class_start]), softcap);
    }
    if (entries.end > entries.begin) target_dot[row] += dot;
  }
}

HUGEHEAD_CPU_ROWS_LAUNCH(sparse_chunk_stats_cpu, SparseChunkStatsParams, sparse_chunk_stats_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("sparse_chunk_stats_", &entry::sparse_chunk_stats<sparse_chunk_stats_cpu>); }

}  // namespace hugehead
