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

// kernel<<<p.rows blocks of kRowThreads>>>(p) on the current stream of the logits' device.
template <typename Params>
void launch_row_blocks(void (*kernel)(Params), const Params& p, const at::Tensor& logits) {
  TORCH_CHECK(p.rows <= std::numeric_limits<int32_t>::max(), "hugehead: too many rows in one chunk");
  const c10::cuda::CUDAGuard guard(logits.device());
  kernel<<<static_cast<unsigned>(p.rows), kRowThreads, 0, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace hugehead
