// CUDA kernel of hugehead::bce_chunk_: one block per row computes the one-vs-all binary cross-entropy of a
// logits chunk against a CSR target: the chunk's per-logit losses summed into the row, and/or each logit
// replaced by its gradient, in one pass (16-byte loads and stores where the row allows; a pack finds the
// row's entries among its columns by binary search, only in rows with entries in the chunk).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/sparse_target.h"

namespace hugehead {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t, typename acc_t, bool kLoss, bool kGrad>
__global__ void __launch_bounds__(kThreads) bce_chunk_kernel(BceChunkParams p) {
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

void bce_chunk_cuda(const at::Tensor& logits, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                    const std::optional<at::Tensor>& entry_weight, int64_t class_start,
                    const std::optional<at::Tensor>& row_loss, const std::optional<at::Tensor>& grad_rows) {
  check_logits_chunk(logits);
  check_csr_target(logits, crow, col, val);
  if (row_loss.has_value()) check_row_vectors(logits, {{"row_loss", &*row_loss}});
  if (grad_rows.has_value()) check_row_vectors(logits, {{"grad_rows", &*grad_rows}});
  if (entry_weight.has_value()) {
    TORCH_CHECK(entry_weight->sizes() == val.sizes() && entry_weight->scalar_type() == val.scalar_type() &&
                    entry_weight->device() == val.device() && entry_weight->is_contiguous(),
                "hugehead: entry_weight must be a contiguous ", val.scalar_type(), " tensor shaped like val ",
                val.sizes(), ", got ", entry_weight->scalar_type(), " ", entry_weight->sizes());
  }
  TORCH_CHECK(logits.size(0) <= std::numeric_limits<int32_t>::max(), "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  BceChunkParams p{logits.data_ptr(),
                   {crow.data_ptr<int64_t>(), col.data_ptr<int64_t>(), val.data_ptr()},
                   entry_weight.has_value() ? entry_weight->data_ptr() : nullptr,
                   row_loss.has_value() ? row_loss->data_ptr() : nullptr,
                   grad_rows.has_value() ? grad_rows->data_ptr() : nullptr,
                   logits.size(0), logits.size(1), logits.stride(0), class_start};
  if (p.rows == 0 || p.cols == 0 || (p.row_loss == nullptr && p.grad_rows == nullptr)) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(p.rows));
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "bce_chunk_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    if (p.row_loss != nullptr && p.grad_rows != nullptr) {
      bce_chunk_kernel<scalar_t, acc_t, true, true><<<grid, kThreads, 0, stream>>>(p);
    } else if (p.row_loss != nullptr) {
      bce_chunk_kernel<scalar_t, acc_t, true, false><<<grid, kThreads, 0, stream>>>(p);
    } else {
      bce_chunk_kernel<scalar_t, acc_t, false, true><<<grid, kThreads, 0, stream>>>(p);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("bce_chunk_", &bce_chunk_cuda); }

}  // namespace hugehead
