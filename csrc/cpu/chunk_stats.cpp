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
  cpu::class_id_stats_rows<scalar_t, acc_t>(
      p, begin, end, [&](int64_t row, const scalar_t* z) { cpu::fold_row_stats<acc_t>(p, row, z, nullptr); });
}

HUGEHEAD_CPU_ROWS_LAUNCH(chunk_stats_cpu, ChunkStatsParams, chunk_stats_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_stats_", &entry::chunk_stats<chunk_stats_cpu>); }

}  // namespace hugehead
