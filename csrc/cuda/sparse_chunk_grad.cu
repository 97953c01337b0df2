// CUDA kernel of hugehead::sparse_chunk_grad_: one block per row turns a logits chunk into the gradient
// of the softmax with a CSR probability target, in place: every logit is read once and written once
// (16-byte loads and stores where the row allows) as a non-entry, and the row's entries in the chunk are
// written again afterwards from their logits, stashed in shared memory first. A row with more entries in
// the chunk than the stash holds takes one pass in which each pack finds its entries by binary search
// (H200, xc1M's rows plan with 5 entries a row: that search made the kernel 2.2x chunk_grad_'s time).
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

template <typename scalar_t, typename acc_t, bool kWeighted>
__global__ void __launch_bounds__(cuda::kRowThreads) sparse_chunk_grad_kernel(SparseChunkGradParams p) {
  const int64_t row = blockIdx.x;
  scalar_t* logits = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
  const acc_t g = static_cast<const acc_t*>(p.grad_rows)[row];
  const acc_t gl = p.grad_lse == nullptr ? acc_t(0) : static_cast<const acc_t*>(p.grad_lse)[row];
  if (g == acc_t(0) && gl == acc_t(0)) {  // rows without gradient: exact zeros, whatever the logits hold
    cuda::zero_row(logits, p.cols);
    return;
  }
  const acc_t lse = static_cast<const acc_t*>(p.lse)[row];
  const acc_t mass = static_cast<const acc_t*>(p.target_mass)[row];
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const acc_t eps = static_cast<acc_t>(p.label_smoothing);
  const acc_t smooth = eps / static_cast<acc_t>(p.num_classes);
  const acc_t z_term = acc_t(2) * static_cast<acc_t>(p.z_loss) * lse;
  const auto* weight = static_cast<const acc_t*>(p.class_weight);
  const auto* val = static_cast<const acc_t*>(p.target.val);
  const int64_t* col = p.target.col;
  const int64_t cs = p.class_start;
  auto grad = [&](acc_t z, int64_t j, bool is_entry, acc_t entry_value) {
    const acc_t sm = kWeighted ? smooth * weight[j] : smooth;
    return sparse_logit_grad(z, is_entry, entry_value, lse, g, gl, mass, z_term, sm, acc_t(1) - eps, softcap);
  };
  const EntryRange entries = chunk_entries(p.target.crow, col, row, cs, p.cols);
  const auto as_non_entries = [&] {
    cuda::for_each_pack_in_row<scalar_t, /*Write=*/true>(logits, p.cols, [&](int64_t j0, auto& pack) {
      constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        pack.v[k] = static_cast<scalar_t>(grad(static_cast<acc_t>(pack.v[k]), j0 + k, false, acc_t(0)));
      }
    });
  };
  if (entries.end == entries.begin) {  // most rows of most chunks
    as_non_entries();
    return;
  }
  constexpr int kStash = 4 * cuda::kRowThreads;
  const int64_t count = entries.end - entries.begin;
  if (count <= kStash) {  // block-uniform: one row per block
    __shared__ acc_t stash[kStash];
    for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
      stash[k] = static_cast<acc_t>(logits[col[entries.begin + k] - cs]);
    }
    __syncthreads();  // every entry's logit read before any thread overwrites it
    as_non_entries();
    __syncthreads();  // and written as a non-entry before its own value replaces that
    for (int64_t k = threadIdx.x; k < count; k += blockDim.x) {
      const int64_t e = entries.begin + k, j = col[e] - cs;
      logits[j] = static_cast<scalar_t>(grad(stash[k], j, true, val[e]));
    }
    return;
  }
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/true>(logits, p.cols, [&](int64_t j0, auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
    // Columns are distinct and sorted: the pack's entries are consecutive from the first one >= j0.
    int64_t e = lower_bound(col, entries.begin, entries.end, cs + j0);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const bool is_entry = e < entries.end && col[e] == cs + j0 + k;
      const acc_t entry_value = is_entry ? val[e] : acc_t(0);
      e += is_entry;
      pack.v[k] = static_cast<scalar_t>(grad(static_cast<acc_t>(pack.v[k]), j0 + k, is_entry, entry_value));
    }
  });
}

void sparse_chunk_grad_cuda(const SparseChunkGradParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "sparse_chunk_grad_cuda", [&] {
    HUGEHEAD_BOOL_SWITCH(p.class_weight != nullptr, kWeighted, [&] {
      cuda::launch_row_blocks(sparse_chunk_grad_kernel<scalar_t, at::opmath_type<scalar_t>, kWeighted>, p, logits);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("sparse_chunk_grad_", &entry::sparse_chunk_grad<sparse_chunk_grad_cuda>); }

}  // namespace hugehead
