// CUDA kernel of hugehead::bce_chunk_: one block per row computes the one-vs-all binary cross-entropy of a
// logits chunk against a CSR target: the chunk's per-logit losses summed into the row, and/or each logit
// replaced by its gradient, in one pass (16-byte loads and stores where the row allows; a pack finds the
// row's entries among its columns by binary search, only in rows with entries in the chunk).
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_launch.cuh"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"
#include "hugehead/sparse_target.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t, bool kLoss, bool kGrad>
__global__ void __launch_bounds__(cuda::kRowThreads) bce_chunk_kernel(BceChunkParams p) {
  const int64_t row = blockIdx.x;
  scalar_t* logits = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
  const acc_t g = kGrad ? static_cast<const acc_t*>(p.grad_rows)[row] : acc_t(0);
  const auto* val = static_cast<const acc_t*>(p.target.val);
  const auto* entry_weight = static_cast<const acc_t*>(p.entry_weight);
  const int64_t* col = p.target.col;
  const int64_t cs = p.class_start;
  acc_t loss = 0;
  auto absent = [&](scalar_t& raw) {
    const acc_t z = static_cast<acc_t>(raw);
    const acc_t e = cuda::fast_exp(-::fabs(z));
    if constexpr (kLoss) loss += bce_absent_loss(z, e);
    if constexpr (kGrad) raw = static_cast<scalar_t>(g * bce_absent_grad(z, e));
  };
  const EntryRange entries = chunk_entries(p.target.crow, col, row, cs, p.cols);
  if (entries.end == entries.begin) {  // most rows of most chunks
    cuda::for_each_pack_in_row<scalar_t, kGrad>(logits, p.cols, [&](auto& pack) {
      constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
      for (int k = 0; k < N; ++k) absent(pack.v[k]);
    });
  } else {
    cuda::for_each_pack_in_row<scalar_t, kGrad>(logits, p.cols, [&](int64_t j0, auto& pack) {
      constexpr int N = std::decay_t<decltype(pack)>::kSize;
      // Columns are distinct and sorted: the pack's entries are consecutive from the first one >= j0.
      int64_t e = lower_bound(col, entries.begin, entries.end, cs + j0);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (e < entries.end && col[e] == cs + j0 + k) {
          const acc_t z = static_cast<acc_t>(pack.v[k]);
          const acc_t ex = cuda::fast_exp(-::fabs(z));
          const acc_t lw = entry_weight == nullptr ? acc_t(1) : entry_weight[e];
          if constexpr (kLoss) loss += bce_entry_loss(z, ex, val[e], lw);
          if constexpr (kGrad) pack.v[k] = static_cast<scalar_t>(g * bce_entry_grad(z, ex, val[e], lw));
          ++e;
        } else {
          absent(pack.v[k]);
        }
      }
    });
  }
  if constexpr (kLoss) {
    loss = cuda::block_sum(loss);
    if (threadIdx.x == 0) static_cast<acc_t*>(p.row_loss)[row] += loss;
  }
}

void bce_chunk_cuda(const BceChunkParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "bce_chunk_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // The entry returned already when neither a loss nor a gradient is asked for.
    auto* kernel = p.grad_rows == nullptr  ? bce_chunk_kernel<scalar_t, acc_t, /*kLoss=*/true, /*kGrad=*/false>
                   : p.row_loss == nullptr ? bce_chunk_kernel<scalar_t, acc_t, false, true>
                                           : bce_chunk_kernel<scalar_t, acc_t, true, true>;
    cuda::launch_row_blocks(kernel, p, logits);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("bce_chunk_", &entry::bce_chunk<bce_chunk_cuda>); }

}  // namespace hugehead
