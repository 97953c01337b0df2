// CUDA kernels of hugehead::distill_chunk_stats_ and distill_chunk_grad_: a student logits chunk against the
// teacher's logits of the same classes (distill.h holds the math). One block per row, the row swept in 16-byte
// packs of the student chunk: the statistics fold per thread the student's online log-sum-exp and the divergence's
// sums (the KLs' against the running maxima of both heads), then merge them in a fixed tree (deterministic); the
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

// Folds a pack's values v with weights w into a thread's (max, sum of exps, sum of exp(v - max) w), rescaling once
// per pack; -inf counts exp(-inf) = 0, a NaN reaches both sums (s * 0, not 0, keeps one already there).
template <int N, typename acc_t>
__device__ __forceinline__ void fold_weighted(const acc_t (&v)[N], const acc_t (&w)[N], acc_t& m, acc_t& s,
                                              acc_t& a) {
  acc_t pm = v[0];
#pragma unroll
  for (int k = 1; k < N; ++k) pm = ::fmax(pm, v[k]);  // NaN-ignoring: a NaN is caught below
  if (pm > m) {
    const acc_t scale = m == neg_inf<acc_t>() ? acc_t(0) : cuda::fast_exp(m - pm);
    s *= scale;
    a *= scale;
    m = pm;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (m == neg_inf<acc_t>()) {  // every value so far is -inf or NaN
      if (v[k] != v[k]) s = a = v[k];
      continue;
    }
    const acc_t e = cuda::fast_exp(v[k] - m);
    s += e;
    a += prob_times(e, w[k]);
  }
}

// JSD: its terms summed against both log-sum-exps given, beside the student's online log-sum-exp.
template <typename scalar_t, typename acc_t, typename teacher_t, bool kSoftcap>
__global__ void __launch_bounds__(cuda::kRowThreads) jsd_stats_kernel(DistillStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  const teacher_t* teacher = static_cast<const teacher_t*>(p.teacher) + row * p.teacher_stride;
  const DistillRow<acc_t> r = distill_row<acc_t>(p, static_cast<const acc_t*>(p.teacher_lse)[row],
                                                 static_cast<const acc_t*>(p.student_lse)[row]);
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
      jsd_terms(v[k], apply_softcap(static_cast<acc_t>(teacher[j0 + k]), teacher_softcap), r, sum, part);
    }
  });
  cuda::block_reduce_lse(m, s, sum);
  part = cuda::block_sum(part);
  if (threadIdx.x == 0) {
    lse_merge(static_cast<acc_t*>(p.row_max)[row], static_cast<acc_t*>(p.row_sumexp)[row], m, s);
    static_cast<acc_t*>(p.logit_sum)[row] += sum;
    static_cast<acc_t*>(p.target_logit)[row] += part;
  }
}

// The two KLs, online: the student's (max, sum of exps, sum exp(s - max) (s - u)) and the teacher's (max, sum of
// exps, sum exp(u - max) (u - s)) per thread, each merged over the block, then into the running statistics
// (reverse KL keeps the student's weighted sum, forward KL the teacher's mean; distill.h).
template <typename scalar_t, typename acc_t, typename teacher_t, bool kSoftcap, bool kReverse>
__global__ void __launch_bounds__(cuda::kRowThreads) kl_stats_kernel(DistillStatsParams p) {
  const int64_t row = blockIdx.x;
  const acc_t softcap = static_cast<acc_t>(p.softcap), teacher_softcap = static_cast<acc_t>(p.teacher_softcap);
  auto* logits = const_cast<scalar_t*>(static_cast<const scalar_t*>(p.logits)) + row * p.row_stride;
  const teacher_t* teacher = static_cast<const teacher_t*>(p.teacher) + row * p.teacher_stride;
  acc_t m = neg_inf<acc_t>(), s = 0, a = 0, mt = neg_inf<acc_t>(), st = 0, at = 0;
  cuda::for_each_pack_in_row<scalar_t, /*Write=*/false>(logits, p.cols, [&](int64_t j0, auto& pack) {
    constexpr int N = std::decay_t<decltype(pack)>::kSize;
    acc_t v[N], u[N], d[N], nd[N];
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = kSoftcap ? apply_softcap(static_cast<acc_t>(pack.v[k]), softcap) : static_cast<acc_t>(pack.v[k]);
      u[k] = apply_softcap(static_cast<acc_t>(teacher[j0 + k]), teacher_softcap);
      d[k] = v[k] - u[k];
      nd[k] = -d[k];
    }
    fold_weighted(v, d, m, s, a);
    fold_weighted(u, nd, mt, st, at);
  });
  cuda::block_reduce_triple<cuda::kRowThreads>(m, s, a, scaled_merge<acc_t>);
  cuda::block_reduce_triple<cuda::kRowThreads>(mt, st, at, scaled_merge<acc_t>);
  if (threadIdx.x == 0) {
    auto& row_max = static_cast<acc_t*>(p.row_max)[row];
    auto& row_sumexp = static_cast<acc_t*>(p.row_sumexp)[row];
    auto& logit_sum = static_cast<acc_t*>(p.logit_sum)[row];
    auto& target_logit = static_cast<acc_t*>(p.target_logit)[row];
    acc_t lse_t, mean_t;
    lse_and_mean(mt, st, at, lse_t, mean_t);
    if (kReverse) {
      scaled_merge(row_max, row_sumexp, logit_sum, m, s, a);
      target_logit = log_add_exp(target_logit, lse_t);
    } else {
      lse_merge(row_max, row_sumexp, m, s);
      lse_mean_merge(target_logit, logit_sum, lse_t, mean_t);
    }
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
        const auto div = static_cast<Divergence>(p.divergence);
        if (div == Divergence::kJSD) {
          cuda::launch_row_blocks(jsd_stats_kernel<scalar_t, acc_t, teacher_t, kSoftcap>, p, logits);
        } else if (div == Divergence::kReverseKL) {
          cuda::launch_row_blocks(kl_stats_kernel<scalar_t, acc_t, teacher_t, kSoftcap, true>, p, logits);
        } else {
          cuda::launch_row_blocks(kl_stats_kernel<scalar_t, acc_t, teacher_t, kSoftcap, false>, p, logits);
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
