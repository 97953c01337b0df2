// CUDA kernels of hugehead::distill_chunk_stats_ and distill_chunk_grad_: a student logits chunk against the
// teacher's logits of the same classes (distill.h holds the math). One block per row, the row swept in 16-byte
// packs of the student chunk: the statistics fold the student's online log-sum-exp and the divergence's sums per
// thread (reverse KL's scaled with the running max), then merge them in a fixed tree (deterministic); the
// gradient is elementwise.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_launch.cuh"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/distill.h"
#include "hugehead/entry.h"
#include "hugehead/numerics.h"

namespace hugehead {
namespace {

template <typename scalar_t, typename acc_t, typename teacher_t, bool kSoftcap>
__global__ void __launch_bounds__(cuda::kRowThreads) distill_stats_kernel(DistillStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  const auto div = static_cast<Divergence>(p.divergence);
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  const teacher_t* teacher = static_cast<const teacher_t*>(p.teacher) + row * p.teacher_stride;
  const auto* student_lse = static_cast<const acc_t*>(p.student_lse);
  const DistillRow<acc_t> r = distill_row<acc_t>(p, static_cast<const acc_t*>(p.teacher_lse)[row],
                                                 student_lse == nullptr ? acc_t(0) : student_lse[row]);
  acc_t m = neg_inf<acc_t>(), s = 0, sum = 0, part = 0;
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/false>(logits, p.cols, [&](int64_t j0, auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
    acc_t v[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = kSoftcap ? apply_softcap(static_cast<acc_t>(pack.v[k]), softcap) : static_cast<acc_t>(pack.v[k]);
    }
    acc_t logit_sum_unused = 0;
    cuda::fold_values(v, m, s, logit_sum_unused);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      distill_terms(div, v[k], apply_softcap(static_cast<acc_t>(teacher[j0 + k]), teacher_softcap), r, sum, part);
    }
  });
  cuda::block_reduce_lse(m, s, sum);
  if (div == Divergence::kJSD) part = cuda::block_sum(part);  // div is the block's: every thread calls it or none
  if (threadIdx.x == 0) {
    lse_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row], m, s);
    static_cast<acc_t*>(p.logit_sum)[row] += sum;
    if (div == Divergence::kJSD) static_cast<acc_t*>(p.target_logit)[row] += part;
  }
}

// Reverse KL: sum exp(s - max) (s - u) folded with the student's running max, one exp per element.
template <typename scalar_t, typename acc_t, typename teacher_t, bool kSoftcap>
__global__ void __launch_bounds__(cuda::kRowThreads) reverse_kl_stats_kernel(DistillStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  const teacher_t* teacher = static_cast<const teacher_t*>(p.teacher) + row * p.teacher_stride;
  acc_t m = neg_inf<acc_t>(), s = 0, a = 0;
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/false>(logits, p.cols, [&](int64_t j0, auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
    acc_t v[N];
    acc_t pm = neg_inf<acc_t>();
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = kSoftcap ? apply_softcap(static_cast<acc_t>(pack.v[k]), softcap) : static_cast<acc_t>(pack.v[k]);
      pm = ::fmax(pm, v[k]);  // NaN-ignoring: a NaN reaches both sums through exp below
    }
    if (pm > m) {  // rescale once per pack; s * 0 (not 0) keeps a NaN already there
      const acc_t scale = m == neg_inf<acc_t>() ? acc_t(0) : cuda::fast_exp(m - pm);
      s *= scale;
      a *= scale;
      m = pm;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const acc_t w = v[k] - apply_softcap(static_cast<acc_t>(teacher[j0 + k]), teacher_softcap);
      if (m == neg_inf<acc_t>()) {  // every value so far is -inf or NaN
        if (v[k] != v[k]) {
          s += v[k];
          a += v[k];
        }
        continue;
      }
      const acc_t e = cuda::fast_exp(v[k] - m);
      s += e;
      a += prob_times(e, w);
    }
  });
  cuda::block_reduce_triple<cuda::kRowThreads>(m, s, a, scaled_merge<acc_t>);
  if (threadIdx.x == 0) {
    scaled_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row],
                 static_cast<acc_t*>(p.logit_sum)[row], m, s, a);
  }
}

template <typename scalar_t, typename acc_t, typename teacher_t>
__global__ void __launch_bounds__(cuda::kRowThreads) distill_grad_kernel(DistillGradParams p) {
  const int64_t row = blockIdx.x;
  scalar_t* logits = static_cast<scalar_t*>(p.logits) + row * p.row_stride;
  const acc_t g = static_cast<const acc_t*>(p.grad_rows)[row];
  if (g == acc_t(0)) {  // masked rows: exact zeros, whatever the logits hold
    cuda::zero_row(logits, p.cols);
    return;
  }
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  const auto div = static_cast<Divergence>(p.divergence);
  const teacher_t* teacher = static_cast<const teacher_t*>(p.teacher) + row * p.teacher_stride;
  const DistillRow<acc_t> r = distill_row<acc_t>(p, static_cast<const acc_t*>(p.teacher_lse)[row],
                                                 static_cast<const acc_t*>(p.lse)[row]);
  const auto* coef = static_cast<const acc_t*>(p.coef);
  const acc_t c = coef == nullptr ? acc_t(0) : coef[row];
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/true>(logits, p.cols, [&](int64_t j0, auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const acc_t u = apply_softcap(static_cast<acc_t>(teacher[j0 + k]), teacher_softcap);
      pack.v[k] = static_cast<scalar_t>(distill_logit_grad(div, static_cast<acc_t>(pack.v[k]), u, r, c, g, softcap));
    }
  });
}

void distill_chunk_stats_cuda(const DistillStatsParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "distill_chunk_stats_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    HUGEHEAD_BOOL_SWITCH(p.teacher_is_acc, kAcc, [&] {
      using teacher_t = std::conditional_t<kAcc, acc_t, scalar_t>;
      HUGEHEAD_BOOL_SWITCH(p.softcap > 0, kSoftcap, [&] {
        if (static_cast<Divergence>(p.divergence) == Divergence::kReverseKL) {
          cuda::launch_row_blocks(reverse_kl_stats_kernel<scalar_t, acc_t, teacher_t, kSoftcap>, p, logits);
        } else {
          cuda::launch_row_blocks(distill_stats_kernel<scalar_t, acc_t, teacher_t, kSoftcap>, p, logits);
        }
      });
    });
  });
}

void distill_chunk_grad_cuda(const DistillGradParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "distill_chunk_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    HUGEHEAD_BOOL_SWITCH(p.teacher_is_acc, kAcc, [&] {
      using teacher_t = std::conditional_t<kAcc, acc_t, scalar_t>;
      cuda::launch_row_blocks(distill_grad_kernel<scalar_t, acc_t, teacher_t>, p, logits);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) {
  m.impl("distill_chunk_stats_", &entry::distill_chunk_stats<distill_chunk_stats_cuda>);
  m.impl("distill_chunk_grad_", &entry::distill_chunk_grad<distill_chunk_grad_cuda>);
}

}  // namespace hugehead
