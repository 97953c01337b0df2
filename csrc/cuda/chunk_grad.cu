// CUDA kernel of hugehead::chunk_grad_: one block per (row, segment of 16384 columns) turns a logits
// chunk into its gradient in place (16-byte loads and stores where the row allows, four in flight per
// thread). Segments, not a block a row, and a row's segments side by side in the grid: with a block a
// row, a wide row (1M classes) is one long block and the blocks resident at once each sweep their own row,
// megabytes apart, so a chunk of a few thousand rows runs in a couple of long waves; short segments adjacent
// in memory keep the grid's concurrent reads close together and the waves short.
// The result is elementwise: the same bits whatever the split. The plain loss of
// 16-bit logits (no label smoothing, z-loss, softcap or returned lse: kPlain) takes g * exp(z - lse) with
// the SFU's exponential (one FFMA and one MUFU.EX2, cuda::exp_minus, as the fused gradient GEMM): the general
// formula with the accurate expf takes about 16 instructions an element, this one 4.5 (SASS), in the rows
// plan's largest memory-bound pass; the SFU's error (a few ulp of float, terms below 2^-126
// flushed) is far below the 16-bit rounding of the result.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_launch.cuh"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t, bool kPlain>
__global__ void __launch_bounds__(cuda::kRowThreads)
chunk_grad_kernel(ChunkGradParams p, int64_t segments, int64_t seg_cols) {
  static_assert(!kPlain || sizeof(scalar_t) == 2, "the SFU exponential is for 16-bit logits only");
  const int64_t row = blockIdx.x / segments;  // launch_row_blocks: a row's segments side by side
  const int64_t c0 = (blockIdx.x % segments) * seg_cols;
  const int64_t cols = p.cols - c0 < seg_cols ? p.cols - c0 : seg_cols;  // this block's columns [c0, c0 + cols)
  scalar_t* logits = static_cast<scalar_t*>(p.logits) + row * p.row_stride + c0;
  const acc_t g = static_cast<const acc_t*>(p.grad_rows)[row];
  const acc_t gl = p.grad_lse == nullptr ? acc_t(0) : static_cast<const acc_t*>(p.grad_lse)[row];
  if (g == acc_t(0) && gl == acc_t(0)) {  // ignored rows: exact zeros, whatever the logits hold
    cuda::zero_row(logits, cols);
    return;
  }
  const acc_t lse = static_cast<const acc_t*>(p.lse)[row];
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const acc_t eps = static_cast<acc_t>(p.label_smoothing);
  const acc_t smooth = eps / static_cast<acc_t>(p.num_classes);
  const acc_t z_term = acc_t(2) * static_cast<acc_t>(p.z_loss) * lse;
  const int64_t t = p.target[row] - p.class_start - c0;  // the target's column in this segment
  const bool has_target = t >= 0 && t < cols;
  // The target's logit is read before any thread overwrites it; every element is then written with the
  // non-target formula (no index compare per element) and thread 0 rewrites the target's afterwards.
  __shared__ acc_t target_z;
  if (has_target) {
    if (threadIdx.x == 0) target_z = static_cast<acc_t>(logits[t]);
    __syncthreads();
  }
  auto grad = [&](acc_t z, bool is_target) {
    return logit_grad(z, is_target, lse, g, gl, z_term, smooth, acc_t(1) - eps, softcap);
  };
  if (kPlain && gl == acc_t(0)) {
    // g p with p = exp(z - lse) as the fused gradient GEMM's epilogue computes it (cuda::exp_minus)
    const float lse_log2e = lse * cuda::kLog2e;
    cuda::for_each_pack_in_row<scalar_t, /*Write=*/true, /*kUnroll=*/4>(logits, cols, [&](auto& pack) {
      constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        pack.v[k] = static_cast<scalar_t>(g * cuda::exp_minus(static_cast<float>(pack.v[k]), lse_log2e));
      }
    });
  } else {
    cuda::for_each_pack_in_row<scalar_t, /*Write=*/true, /*kUnroll=*/4>(logits, cols, [&](auto& pack) {
      constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
      for (int k = 0; k < N; ++k) pack.v[k] = static_cast<scalar_t>(grad(static_cast<acc_t>(pack.v[k]), false));
    });
  }
  if (has_target) {
    __syncthreads();
    if (threadIdx.x == 0) logits[t] = static_cast<scalar_t>(grad(target_z, true));
  }
}

// Columns a block: a multiple of 8 (a segment starts 16-byte aligned where its row does), wide enough that a
// block's row setup is amortized and narrow enough that a chunk of few rows still fills the GPU.
constexpr int64_t kSegmentCols = 16384;

template <typename scalar_t>
void launch_chunk_grad(const ChunkGradParams& p, const at::Tensor& logits) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t width = std::max<int64_t>(p.cols, 1);
  const int64_t seg = std::min(kSegmentCols, width);
  const int64_t segments = (width + seg - 1) / seg;
  auto* kernel = chunk_grad_kernel<scalar_t, acc_t, false>;
  if constexpr (sizeof(scalar_t) == 2) {
    if (p.label_smoothing == 0 && p.z_loss == 0 && p.softcap <= 0) kernel = chunk_grad_kernel<scalar_t, acc_t, true>;
  }
  cuda::launch_row_blocks(kernel, p, logits, segments, segments, seg);
}

void chunk_grad_cuda(const ChunkGradParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_grad_cuda", [&] { launch_chunk_grad<scalar_t>(p, logits); });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("chunk_grad_", &entry::chunk_grad<chunk_grad_cuda>); }

}  // namespace hugehead
