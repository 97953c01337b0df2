// CPU kernel of hugehead::chunk_grad_: a logits chunk becomes its gradient in place.
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
  cpu::for_each_grad_row<scalar_t, acc_t>(p, begin, end, [&](int64_t row, scalar_t* z, const cpu::RowGrad<acc_t>& r) {
    const int64_t t = p.target[row] - p.class_start;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (softcap <= acc_t(0)) {  // the common case, vectorized
        cpu::row_grad_f32(z, p.cols, t, r.lse, r.g, r.g_lse, r.z_term, smooth, acc_t(1) - eps);
        return;
      }
    }
    for (int64_t j = 0; j < p.cols; ++j) {
      z[j] = static_cast<scalar_t>(logit_grad(static_cast<acc_t>(z[j]), j == t, r.lse, r.g, r.g_lse, r.z_term,
                                              smooth, acc_t(1) - eps, softcap));
    }
  });
}

HUGEHEAD_CPU_ROWS_LAUNCH(chunk_grad_cpu, ChunkGradParams, chunk_grad_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_grad_", &entry::chunk_grad<chunk_grad_cpu>); }

}  // namespace hugehead
