// CPU kernel of hugehead::sparse_chunk_grad_: a logits chunk becomes the gradient of the softmax with
// probability targets (a CSR target) in place.
#include <torch/library.h>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"
#include "hugehead/sparse_target.h"

#include <type_traits>
#include <vector>

namespace hugehead {
namespace {

// One row in float32 without softcap or class weights, every element as a non-entry:
//   z_j <- g ((mass p_j - smooth) + p_j z_term) + g_lse p_j
// (sparse_logit_grad's formula, rounding aside); the caller rewrites the entries afterwards.
HUGEHEAD_CPU_CLONES
void row_grad_mass_f32(float* z, int64_t cols, float lse, float g, float g_lse, float mass, float z_term,
                       float smooth) {
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    const float prob = cpu::exp_nonpositive(z[j] - lse);
    const float d = (mass * prob - smooth) + prob * z_term;
    z[j] = g * d + g_lse * prob;
  }
}

template <typename scalar_t, typename acc_t>
void sparse_chunk_grad_rows(const SparseChunkGradParams& p, int64_t begin, int64_t end) {
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const acc_t eps = static_cast<acc_t>(p.label_smoothing);
  const acc_t smooth = eps / static_cast<acc_t>(p.num_classes);
  const auto* mass = static_cast<const acc_t*>(p.target_mass);
  const auto* weight = static_cast<const acc_t*>(p.class_weight);
  const auto* val = static_cast<const acc_t*>(p.target.val);
  std::vector<acc_t> entry_logits;  // the entries' logits, read before the row is overwritten
  cpu::for_each_grad_row<scalar_t, acc_t>(p, begin, end, [&](int64_t row, scalar_t* z, const cpu::RowGrad<acc_t>& r) {
    const acc_t mass_row = mass[row];
    const EntryRange entries = chunk_entries(p.target.crow, p.target.col, row, p.class_start, p.cols);
    entry_logits.resize(static_cast<size_t>(entries.end - entries.begin));
    for (int64_t e = entries.begin; e < entries.end; ++e) {
      entry_logits[e - entries.begin] = static_cast<acc_t>(z[p.target.col[e] - p.class_start]);
    }
    bool done = false;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (softcap <= acc_t(0) && weight == nullptr) {  // the common case, vectorized
        row_grad_mass_f32(z, p.cols, r.lse, r.g, r.g_lse, mass_row, r.z_term, smooth);
        done = true;
      }
    }
    if (!done) {
      for (int64_t j = 0; j < p.cols; ++j) {
        const acc_t sm = weight == nullptr ? smooth : smooth * weight[j];
        z[j] = static_cast<scalar_t>(sparse_logit_grad(static_cast<acc_t>(z[j]), false, acc_t(0), r.lse, r.g,
                                                       r.g_lse, mass_row, r.z_term, sm, acc_t(1) - eps, softcap));
      }
    }
    for (int64_t e = entries.begin; e < entries.end; ++e) {
      const int64_t j = p.target.col[e] - p.class_start;
      const acc_t sm = weight == nullptr ? smooth : smooth * weight[j];
      z[j] = static_cast<scalar_t>(sparse_logit_grad(entry_logits[e - entries.begin], true, val[e], r.lse, r.g,
                                                     r.g_lse, mass_row, r.z_term, sm, acc_t(1) - eps, softcap));
    }
  });
}

HUGEHEAD_CPU_ROWS_LAUNCH(sparse_chunk_grad_cpu, SparseChunkGradParams, sparse_chunk_grad_rows)

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("sparse_chunk_grad_", &entry::sparse_chunk_grad<sparse_chunk_grad_cpu>); }

}  // namespace hugehead
