// CPU kernel of hugehead::chunk_grad_: a logits chunk becomes its gradient in place.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

#include <type_traits>

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t>
void chunk_grad_rows(const ChunkGradParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const acc_t eps = static_cast<acc_t>(p.label_smoothing);
  const acc_t smooth = eps / static_cast<acc_t>(p.num_classes);
  const auto* lse = static_cast<const acc_t*>(p.lse);
  const auto* grad_rows = static_cast<const acc_t*>(p.grad_rows);
  const auto* grad_lse = static_cast<const acc_t*>(p.grad_lse);
  for (int64_t row = begin; row < end; ++row) {
    scalar_t* z = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
    const acc_t g = grad_rows[row];
    const acc_t gl = grad_lse == nullptr ? acc_t(0) : grad_lse[row];
    if (g == acc_t(0) && gl == acc_t(0)) {  // ignored rows: exact zeros, whatever the logits hold
      for (int64_t j = 0; j < p.cols; ++j) z[j] = scalar_t(0);
      continue;
    }
    const acc_t l = lse[row];
    const acc_t z_term = acc_t(2) * static_cast<acc_t>(p.z_loss) * l;
    const int64_t t = p.target[row] - p.class_start;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (softcap <= acc_t(0)) {  // the common case, vectorized
        cpu::row_grad_f32(z, p.cols, t, l, g, gl, z_term, smooth, acc_t(1) - eps);
        continue;
      }
    }
    for (int64_t j = 0; j < p.cols; ++j) {
      const acc_t d = logit_grad(static_cast<acc_t>(z[j]), j == t, l, g, gl, z_term, smooth, acc_t(1) - eps,
                                 softcap);
      z[j] = static_cast<scalar_t>(d);
    }
  }
}

void chunk_grad_cpu(const ChunkGradParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_grad_cpu", [&] {
    cpu::parallel_rows(p, chunk_grad_rows<scalar_t, at::opmath_type<scalar_t>>);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_grad_", &entry::chunk_grad<chunk_grad_cpu>); }

}  // namespace hugehead
