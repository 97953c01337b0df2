// CUDA kernels of hugehead::scale_ and hugehead::row_scale (below). scale_: self *= scale in place over a dense tensor, the scale read from device
// memory (no host synchronization). A grid-stride loop of 16-byte loads and stores over the 16-byte aligned
// body, kUnroll of them in flight per thread, and a scalar head and tail: ATen's mul_ by a 0-d CUDA tensor
// runs its unvectorized strided kernel (a stride-0 operand) at ~0.9 TB/s on an H200. A scale of 1 writes
// nothing (each element times 1 rounds back to itself).
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/entry.h"

namespace hugehead {
namespace {

constexpr int kScaleThreads = 256;
constexpr int kUnroll = 4;

template <typename scalar_t, typename opmath_t>
__device__ __forceinline__ scalar_t scaled(scalar_t v, opmath_t s) {
  return static_cast<scalar_t>(static_cast<opmath_t>(v) * s);
}

template <typename scalar_t, typename opmath_t, typename scale_t>
__global__ void __launch_bounds__(kScaleThreads) scale_kernel(ScaleParams p) {
  using Pack = cuda::Vec16<scalar_t>;
  constexpr int V = Pack::kSize;
  scalar_t* data = static_cast<scalar_t*>(p.data);
  const opmath_t s = static_cast<opmath_t>(*static_cast<const scale_t*>(p.scale));
  // A scale of 1 (loss.backward() of the loss itself: the usual grad_output) leaves every element as it is:
  // the blocks return without touching the data (the rows plan's backward then costs no pass over dX / dW).
  if (s == opmath_t(1)) return;
  const int64_t n = p.numel;
  // Elements before the first 16-byte boundary (a view that starts mid-pack); torch's pointers are always
  // aligned to the element size.
  const uintptr_t addr = reinterpret_cast<uintptr_t>(data);
  const int64_t head = std::min<int64_t>(n, static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(scalar_t)));
  const int64_t packs = (n - head) / V;
  const int64_t tail = head + packs * V;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  Pack* body = reinterpret_cast<Pack*>(data + head);
  int64_t i = tid;
  for (; i + (kUnroll - 1) * threads < packs; i += kUnroll * threads) {
    Pack v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = body[i + u * threads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < V; ++k) v[u].v[k] = scaled(v[u].v[k], s);
      body[i + u * threads] = v[u];
    }
  }
  for (; i < packs; i += threads) {
    Pack v = body[i];
#pragma unroll
    for (int k = 0; k < V; ++k) v.v[k] = scaled(v.v[k], s);
    body[i] = v;
  }
  // The head [0, head) and the tail [tail, n): fewer than 2 V elements, one per thread.
  const int64_t rest = head + (n - tail);
  if (tid < rest) {
    const int64_t j = tid < head ? tid : tail + (tid - head);
    data[j] = scaled(data[j], s);
  }
}

void scale_cuda(const ScaleParams& p, const at::Tensor& self) {
  const c10::cuda::CUDAGuard guard(self.device());
  // Enough resident blocks to fill the device once; a grid-stride loop covers the rest.
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t resident = static_cast<int64_t>(props->multiProcessorCount) *
                           (props->maxThreadsPerMultiProcessor / kScaleThreads);
  const int64_t per_block = static_cast<int64_t>(kScaleThreads) * kUnroll * (16 / self.element_size());
  const int64_t needed = (p.numel + per_block - 1) / per_block;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(resident, needed)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  HUGEHEAD_DISPATCH_LOGITS(self.scalar_type(), "scale_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    if (p.scale_is_double) {
      scale_kernel<scalar_t, opmath_t, double><<<blocks, kScaleThreads, 0, stream>>>(p);
    } else {
      scale_kernel<scalar_t, opmath_t, float><<<blocks, kScaleThreads, 0, stream>>>(p);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// row_scale: out[i, j] = x[i, j] * scale[i]. Where every row starts 16-byte aligned in both tensors and the width
// is a whole number of 16-byte packs, a grid-stride loop over the packs of all rows (16-byte loads and stores,
// kUnroll in flight); else one element a step. Each element is written once, from its own x and its row's scale.
template <typename scalar_t, typename opmath_t, bool kPacked>
__global__ void __launch_bounds__(kScaleThreads) row_scale_kernel(RowScaleParams p) {
  using Pack = std::conditional_t<kPacked, cuda::Vec16<scalar_t>, cuda::Vec1<scalar_t>>;
  constexpr int V = Pack::kSize;
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  scalar_t* out = static_cast<scalar_t*>(p.out);
  const opmath_t* scale = static_cast<const opmath_t*>(p.scale);
  const int64_t per_row = p.cols / V;
  const int64_t packs = p.rows * per_row;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < packs;
       base += kUnroll * threads) {
    Pack v[kUnroll];
    int64_t row[kUnroll], col[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = base + u * threads;
      row[u] = k / per_row;
      col[u] = (k - row[u] * per_row) * V;
      if (k < packs) v[u] = *reinterpret_cast<const Pack*>(x + row[u] * p.x_stride + col[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * threads >= packs) break;
      const opmath_t s = scale[row[u]];
#pragma unroll
      for (int e = 0; e < V; ++e) v[u].v[e] = scaled(v[u].v[e], s);
      *reinterpret_cast<Pack*>(out + row[u] * p.out_stride + col[u]) = v[u];
    }
  }
}

void row_scale_cuda(const RowScaleParams& p, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t size = out.element_size();
  const int64_t v = 16 / size;
  const bool packed = p.cols % v == 0 && p.out_stride % v == 0 && p.x_stride % v == 0 &&
                      reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t resident = static_cast<int64_t>(props->multiProcessorCount) *
                           (props->maxThreadsPerMultiProcessor / kScaleThreads);
  const int64_t packs = p.rows * (p.cols / (packed ? v : 1));
  const int64_t needed = (packs + kScaleThreads * kUnroll - 1) / (kScaleThreads * kUnroll);
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min(resident, needed)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  HUGEHEAD_DISPATCH_LOGITS(out.scalar_type(), "row_scale_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    HUGEHEAD_BOOL_SWITCH(packed, kPacked, [&] {
      row_scale_kernel<scalar_t, opmath_t, kPacked><<<blocks, kScaleThreads, 0, stream>>>(p);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) {
  m.impl("scale_", &entry::scale<scale_cuda>);
  m.impl("row_scale", &entry::row_scale<row_scale_cuda>);
}

}  // namespace hugehead
