// How the CPU kernels share a chunk's rows out: blocks of rows on ATen's thread pool.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace hugehead {
namespace cpu {

// Runs rows(p, begin, end) over blocks of p's rows on ATen's thread pool, each block reading ~64k logits
// (p: any params struct with rows and cols).
template <typename Params>
void parallel_rows(const Params& p, void (*rows)(const Params&, int64_t, int64_t)) {
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, p.cols));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) { rows(p, begin, end); });
}

}  // namespace cpu
}  // namespace hugehead
