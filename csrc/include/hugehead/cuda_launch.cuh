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

// kernel<<<(p.rows, segments) blocks of kRowThreads>>>(p, extra...) on the current stream of the logits'
// device: blockIdx.x the row, blockIdx.y the row's segment (1 by default).
template <typename Params, typename... Extra>
void launch_row_blocks(void (*kernel)(Params, Extra...), const Params& p, const at::Tensor& logits,
                       unsigned segments = 1, Extra... extra) {
  TORCH_CHECK(p.rows <= std::numeric_limits<int32_t>::max(), "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  const dim3 grid(static_cast<unsigned>(p.rows), segments);
  kernel<<<grid, kRowThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p, extra...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace hugehead
