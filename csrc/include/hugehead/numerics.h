// The per-element math of the loss, shared by the CPU and CUDA kernels so both compute one formula.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <limits>
#include <type_traits>

namespace hugehead {

template <typename acc_t>
C10_HOST_DEVICE inline acc_t neg_inf() {
  return -std::numeric_limits<acc_t>::infinity();
}

// softcap * tanh(z / softcap) (Gemma 2), or z when softcap <= 0.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t apply_softcap(acc_t z, acc_t softcap) {
  return softcap > acc_t(0) ? softcap * std::tanh(z / softcap) : z;
}

// The softcapped logit and, in dcdz, its derivative by z (1 without softcap): the gradients' chain rule.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t softcap_with_slope(acc_t z, acc_t softcap, acc_t& dcdz) {
  if (softcap > acc_t(0)) {
    const acc_t t = std::tanh(z / softcap);
    dcdz = acc_t(1) - t * t;
    return softcap * t;
  }
  dcdz = acc_t(1);
  return z;
}

// exp(v - m) for the running sum, with exp(-inf - -inf) taken as 0 rather than NaN so an all -inf row
// keeps a zero sum; any NaN still propagates.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t exp_shifted(acc_t v, acc_t m) {
  return v == neg_inf<acc_t>() ? acc_t(0) : std::exp(v - m);
}

// a * b rounded on its own: on the device, a product nvcc may not contract into an FMA with the sum it feeds.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t mul_rounded(acc_t a, acc_t b) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same_v<acc_t, float>) {
    return __fmul_rn(a, b);
  } else if constexpr (std::is_same_v<acc_t, double>) {
    return __dmul_rn(a, b);
  }
#endif
  return a * b;
}

// Merge two (max, sumexp) pairs of the online log-sum-exp. Both products are rounded, then added, as the CPU
// computes them: left to itself nvcc contracts one of the two into an FFMA, and which one it picked differed
// between two instances of one kernel (sm_90a SASS of merge_partials_kernel with and without logit sums: `s2 e2`
// contracted in one, `s e1` in the other), so the same partials merged to other sums of exps.
template <typename acc_t>
C10_HOST_DEVICE inline void lse_merge(acc_t& m, acc_t& s, acc_t m2, acc_t s2) {
  const acc_t mm = m > m2 ? m : m2;
  s = mul_rounded(s, exp_shifted(m, mm)) + mul_rounded(s2, exp_shifted(m2, mm));
  m = mm;
}

// Merge two (max, sumexp, shifted) triples of the online entropy, shifted = sum_j exp(v_j - max) (v_j - max):
// moving a side to the larger max mm adds (max - mm) sumexp to its shifted sum before both are rescaled. An empty
// side (sumexp 0, max -inf) adds nothing; a NaN in either propagates.
template <typename acc_t>
C10_HOST_DEVICE inline void entropy_merge(acc_t& m, acc_t& s, acc_t& a, acc_t m2, acc_t s2, acc_t a2) {
  const acc_t mm = m > m2 ? m : m2;
  const acc_t e1 = exp_shifted(m, mm), e2 = exp_shifted(m2, mm);
  const acc_t d1 = s == acc_t(0) ? acc_t(0) : (m - mm) * s;
  const acc_t d2 = s2 == acc_t(0) ? acc_t(0) : (m2 - mm) * s2;
  a = mul_rounded(a + d1, e1) + mul_rounded(a2 + d2, e2);
  s = mul_rounded(s, e1) + mul_rounded(s2, e2);
  m = mm;
}

// One element of the log-probability-with-entropy gradient (entropy_chunk_grad_): with c the (softcapped) logit,
// lp = c - lse and p = exp(lp), g (p - onehot) - g_entropy p (lp + entropy), times dsoftcap/dz. (dH/dc_j =
// -p_j (c_j - sum_k p_k c_k) = -p_j (lp_j + H): lse and the mean logit never meet as large numbers.)
template <typename acc_t>
C10_HOST_DEVICE inline acc_t entropy_logit_grad(acc_t z, bool is_target, acc_t lse, acc_t g, acc_t g_entropy,
                                                acc_t entropy, acc_t softcap) {
  acc_t dcdz;
  const acc_t c = softcap_with_slope(z, softcap, dcdz);
  const acc_t lp = c - lse;
  const acc_t prob = std::exp(lp);
  acc_t d = g * (is_target ? prob - acc_t(1) : prob);
  if (g_entropy != acc_t(0)) d -= g_entropy * prob * (lp + entropy);
  return d * dcdz;
}

// g * dLoss_row/dlogit + g_lse * dlse/dlogit for one element of the softmax with probability targets:
//   (g (mass p - smooth - target_scale v [entry] + p * 2 z_loss lse) + g_lse p) * dsoftcap/dz
// where p = exp(c - lse) and c is the (softcapped) logit; mass = sum_j w_j t'_j (t' the smoothed target),
// smooth = eps / V (times the class weight w_j), target_scale = 1 - eps and v the entry's (class-weighted)
// target value. The z-loss term is added after the target term rather than folded into
// p * (1 + 2 z_loss lse): rounding 1 + 2 z_loss lse would otherwise swamp a small z-loss gradient on a
// confident target (p ~ 1). g_lse is the gradient reaching a returned lse (return_lse=True); with
// g_lse == 0 the rounding is exactly that of g * (d * dcdz).
template <typename acc_t>
C10_HOST_DEVICE inline acc_t sparse_logit_grad(acc_t z, bool is_entry, acc_t entry_value, acc_t lse, acc_t g,
                                               acc_t g_lse, acc_t mass, acc_t z_term, acc_t smooth,
                                               acc_t target_scale, acc_t softcap) {
  acc_t dcdz;
  const acc_t c = softcap_with_slope(z, softcap, dcdz);
  const acc_t prob = std::exp(c - lse);
  acc_t d = mass * prob - smooth;
  if (is_entry) d -= target_scale * entry_value;
  d += prob * z_term;
  if (g_lse == acc_t(0)) return g * (d * dcdz);
  return (g * d + g_lse * prob) * dcdz;
}

// The same for a one-hot target (chunk_grad_): mass 1 and v 1 at the target. Multiplying by 1 is exact, so
// it rounds as that formula written out for one-hot targets does.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t logit_grad(acc_t z, bool is_target, acc_t lse, acc_t g, acc_t g_lse,
                                        acc_t z_term, acc_t smooth_term, acc_t target_weight,
                                        acc_t softcap) {
  return sparse_logit_grad(z, is_target, acc_t(1), lse, g, g_lse, acc_t(1), z_term, smooth_term, target_weight,
                           softcap);
}

}  // namespace hugehead
