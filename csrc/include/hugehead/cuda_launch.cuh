// How the host side launches a kernel that gives each row of a chunk one block: the grid's row limit,
// the device guard and the current stream (a default-stream launch is wrong under torch.compile).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>

namespace hugehead {
namespace cuda {

constexpr int kRowThreads = 256;  // the block of one row: kernels take it as __launch_bounds__

// kernel<<<p.rows * segments blocks of kRowThreads>>>(p, extra...) on the current stream of the logits'
// device. Block b is segment b % segments of row b / segments (segments 1: block b is row b): a row's
// segments are neighbours in the grid, so the blocks resident at once sweep contiguous memory.
template <typename Params, typename... Extra>
void launch_row_blocks(void (*kernel)(Params, Extra...), const Params& p, const at::Tensor& logits,
                       int64_t segments = 1, Extra... extra) {
  TORCH_CHECK(segments >= 1 && p.rows <= std::numeric_limits<int32_t>::max() / segments,
              "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto blocks = static_cast<unsigned>(p.rows * segments);
  kernel<<<blocks, kRowThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p, extra...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace hugehead
