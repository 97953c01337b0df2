// CPU kernels of hugehead::scale_ (self *= scale in place over a dense tensor, in blocks on ATen's thread pool;
// float32 / float64, 16-bit self through ATen's vectorized kernel, the same arithmetic) and hugehead::row_scale
// (out = x * scale[:, None], rows on the thread pool, the product in the accumulation dtype rounded once).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <algorithm>

#include "hugehead/common.h"
#include "hugehead/entry.h"

namespace hugehead {
namespace {

// float32 / float64 self: the product in self's dtype (a float64 scale rounded to float32 once, as mul_).
template <typename scalar_t, typename scale_t>
void scale_span(const ScaleParams& p) {
  scalar_t* data = static_cast<scalar_t*>(p.data);
  const scalar_t s = static_cast<scalar_t>(*static_cast<const scale_t*>(p.scale));
  at::parallel_for(0, p.numel, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) data[i] *= s;
  });
}

void scale_cpu(const ScaleParams& p, const at::Tensor& self) {
  // A scale of 1 leaves every element as it is (as the CUDA kernel, which then writes nothing).
  if (p.scale_is_double ? *static_cast<const double*>(p.scale) == 1.0 : *static_cast<const float*>(p.scale) == 1.0f) {
    return;
  }
  if (self.scalar_type() == at::kHalf || self.scalar_type() == at::kBFloat16) {
    // ATen's CPU kernel, compiled for AVX2/AVX-512 (F16C conversions) which this build does not target: a
    // plain loop here was 1.4x (bfloat16) to 7x (float16) slower. Given a 0-d float tensor it computes in
    // float32 with the whole scale and rounds once, what the CUDA kernel does (given a Scalar, mul_ rounds
    // the scale to self's dtype first).
    const at::Tensor scale = at::from_blob(const_cast<void*>(p.scale), {},
                                           at::TensorOptions().dtype(p.scale_is_double ? at::kDouble : at::kFloat));
    self.mul_(scale);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(self.scalar_type(), "scale_cpu", [&] {
    if (p.scale_is_double) {
      scale_span<scalar_t, double>(p);
    } else {
      scale_span<scalar_t, float>(p);
    }
  });
}

template <typename scalar_t, typename opmath_t>
void row_scale_rows(const RowScaleParams& p) {
  scalar_t* out = static_cast<scalar_t*>(p.out);
  const scalar_t* x = static_cast<const scalar_t*>(p.x);
  const opmath_t* scale = static_cast<const opmath_t*>(p.scale);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, p.cols));
  at::parallel_for(0, p.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const opmath_t s = scale[i];
      const scalar_t* xi = x + i * p.x_stride;
      scalar_t* oi = out + i * p.out_stride;
      for (int64_t j = 0; j < p.cols; ++j) oi[j] = static_cast<scalar_t>(static_cast<opmath_t>(xi[j]) * s);
    }
  });
}

void row_scale_cpu(const RowScaleParams& p, const at::Tensor& out) {
  HUGEHEAD_DISPATCH_LOGITS(out.scalar_type(), "row_scale_cpu", [&] {
    row_scale_rows<scalar_t, at::opmath_type<scalar_t>>(p);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) {
  m.impl("scale_", &entry::scale<scale_cpu>);
  m.impl("row_scale", &entry::row_scale<row_scale_cpu>);
}

}  // namespace hugehead
