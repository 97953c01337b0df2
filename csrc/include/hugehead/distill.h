// The per-element math of distillation (distill_chunk_stats_, distill_chunk_grad_), shared by the CPU and CUDA
// kernels so both compute one formula. With s, u the student's and the teacher's softcapped logits, L_s, L_t their
// log-sum-exps, p = exp(s - L_s), q = exp(u - L_t) and m = beta q + (1 - beta) p:
//   forward KL  KL(q || p) = sum q (u - s) - L_t + L_s           d/ds = p - q
//   reverse KL  KL(p || q) = sum p (s - u) - L_s + L_t           d/ds = p (s - u - sum p (s - u))
//   JSD         beta KL(q || m) + (1 - beta) KL(p || m)          d/ds = p (a - sum p a), a = (1 - beta) log(p / m)
// The kernels fold the sums; the log-sum-exp terms are added by the caller (hugehead/distill.py). The two KLs need
// no log-sum-exp beforehand: a chunk's sum is taken against its own maxima, exp(x - max) (x the teacher's logit for
// forward KL, the student's for reverse KL) as the weight, and merged into the running sums as the maxima grow
// (scaled_merge, lse_mean_merge), the teacher's log-sum-exp folded beside them. JSD's log m needs both
// log-sum-exps first. A term whose probability is 0 counts 0 (its log ratio may be infinite), as F.kl_div's xlogy
// does.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "hugehead/numerics.h"

namespace hugehead {

enum class Divergence : int64_t { kForwardKL = 0, kReverseKL = 1, kJSD = 2 };

// What every element of a row shares.
template <typename acc_t>
struct DistillRow {
  acc_t teacher_lse;
  acc_t student_lse;  // the stats: the student's full log-sum-exp; the gradient: its lse
  acc_t beta;
};

// p v, or 0 where p is 0.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t prob_times(acc_t p, acc_t v) {
  return p > acc_t(0) ? p * v : acc_t(0);
}

// log m = log(beta q + (1 - beta) p) from the two probabilities. Where both underflowed to 0 it is -inf, and the
// terms that use it are then 0 (prob_times); where either is positive, m is too.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t log_mixture(acc_t q, acc_t p, const DistillRow<acc_t>& r) {
  return std::log(r.beta * q + (acc_t(1) - r.beta) * p);
}

// Merge two (max, sumexp, weighted) triples of the online reverse KL, weighted = sum exp(s - max) w: both sums are
// rescaled to the larger max alike (products rounded as lse_merge's). An empty side adds nothing; NaN propagates.
template <typename acc_t>
C10_HOST_DEVICE inline void scaled_merge(acc_t& m, acc_t& s, acc_t& a, acc_t m2, acc_t s2, acc_t a2) {
  const acc_t mm = m > m2 ? m : m2;
  const acc_t e1 = exp_shifted(m, mm), e2 = exp_shifted(m2, mm);
  a = mul_rounded(a, e1) + mul_rounded(a2, e2);
  s = mul_rounded(s, e1) + mul_rounded(s2, e2);
  m = mm;
}

// log(exp(a) + exp(b)), -inf when both are.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t log_add_exp(acc_t a, acc_t b) {
  const acc_t hi = a > b ? a : b;
  if (hi == neg_inf<acc_t>()) return hi;
  return hi + std::log(exp_shifted(a, hi) + exp_shifted(b, hi));
}

// Merge a chunk's (log-sum-exp lc, mean rc under its own softmax) into the running (l, r) of the same kind: the
// means weighted by the two parts' shares of the softmax. The chunk's share is the sigmoid of lc - l, formed from
// exp(-|lc - l|) rather than as exp(lc - log_add_exp(l, lc)): a log-sum-exp of large logits rounds to an absolute
// error of its magnitude's ulp, which a share computed from it would carry as a relative error into r. A side
// without mass (-inf) adds nothing; NaN propagates.
template <typename acc_t>
C10_HOST_DEVICE inline void lse_mean_merge(acc_t& l, acc_t& r, acc_t lc, acc_t rc) {
  if (lc != lc || rc != rc) {
    l = r = lc != lc ? lc : rc;
    return;
  }
  if (lc == neg_inf<acc_t>()) return;
  if (l == neg_inf<acc_t>()) {
    l = lc;
    r = rc;
    return;
  }
  const acc_t d = lc - l;
  const acc_t e = std::exp(-std::fabs(d));  // the smaller part's mass over the larger's
  const acc_t share = (d > acc_t(0) ? acc_t(1) : e) / (acc_t(1) + e);  // the chunk's
  r += prob_times(share, rc - r);
  l = (d > acc_t(0) ? lc : l) + std::log1p(e);
}

// A chunk's (log-sum-exp, weighted mean) from its max m, sum of exps s and weighted sum a (scaled_merge's triple;
// the sums may be held in a wider type than acc_t).
template <typename acc_t, typename sum_t>
C10_HOST_DEVICE inline void lse_and_mean(acc_t m, sum_t s, sum_t a, acc_t& lse, acc_t& mean) {
  lse = m == neg_inf<acc_t>() ? m : m + static_cast<acc_t>(std::log(s));
  mean = static_cast<acc_t>(s > sum_t(0) ? a / s : (s != s ? s : sum_t(0)));
}

// Adds one element's JSD terms to the row's sum and to part (p log(p / m)).
template <typename acc_t>
C10_HOST_DEVICE inline void jsd_terms(acc_t s, acc_t u, const DistillRow<acc_t>& r, acc_t& sum, acc_t& part) {
  const acc_t log_q = u - r.teacher_lse, log_p = s - r.student_lse;
  const acc_t p = std::exp(log_p), q = std::exp(log_q);
  const acc_t log_m = log_mixture(q, p, r);
  const acc_t b = prob_times(p, log_p - log_m);
  sum += r.beta * prob_times(q, log_q - log_m) + (acc_t(1) - r.beta) * b;
  part += b;
}

// One element of g d divergence / dz, z the student's raw logit (its softcap applied here), u the teacher's
// softcapped logit and coef the row's sum p (s - u) (reverse KL) or (1 - beta) sum p log(p / m) (JSD).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t distill_logit_grad(Divergence div, acc_t z, acc_t u, const DistillRow<acc_t>& r,
                                                acc_t coef, acc_t g, acc_t softcap) {
  acc_t dsdz;
  const acc_t s = softcap_with_slope(z, softcap, dsdz);
  const acc_t log_p = s - r.student_lse;
  const acc_t p = std::exp(log_p);
  acc_t d;
  if (div == Divergence::kForwardKL) {
    d = p - std::exp(u - r.teacher_lse);
  } else if (div == Divergence::kReverseKL) {
    d = prob_times(p, s - u - coef);
  } else {
    const acc_t log_m = log_mixture(std::exp(u - r.teacher_lse), p, r);
    d = prob_times(p, (acc_t(1) - r.beta) * (log_p - log_m) - coef);
  }
  return d * g * dsdz;
}

template <typename acc_t, typename Params>
C10_HOST_DEVICE inline DistillRow<acc_t> distill_row(const Params& p, acc_t teacher_lse, acc_t student_lse) {
  return {teacher_lse, student_lse, static_cast<acc_t>(p.beta)};
}

}  // namespace hugehead
