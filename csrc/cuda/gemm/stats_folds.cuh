// The statistics epilogue's arguments and the folds of its 128 x 192 tile (fold_pairs, fold_ref, fold_exact),
// free functions of the arguments so that stats_gemm.cuh's StatsEpilogue stays one screenful of dispatch and
// fold(); the fragment layout and why it is written this way: fused_gemm.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

// Two logits of one row in one 32-bit register: z rounded to Element is exact in Element, so a tile's
// logits take half the registers of its float32 accumulators, and their max is one max.{bf16,f16}x2 a
// pair (exact: the max of the same values, NaNs ignored as fmaxf ignores them).
template <class Element>
struct LogitPair {
  static constexpr bool kBf16 = std::is_same_v<Element, cutlass::bfloat16_t>;
  using Pair = std::conditional_t<kBf16, __nv_bfloat162, __half2>;
  static CUTLASS_DEVICE Pair pack(float a, float b) {
    if constexpr (kBf16) {
      return __floats2bfloat162_rn(a, b);
    } else {
      return __floats2half2_rn(a, b);
    }
  }
  static CUTLASS_DEVICE Pair max(Pair a, Pair b) { return __hmax2(a, b); }
  static CUTLASS_DEVICE float lo(Pair h) { return __low2float(h); }
  static CUTLASS_DEVICE float hi(Pair h) { return __high2float(h); }
};

// The statistics epilogue's kernel arguments (stats_epilogue_arguments fills them from StatsGemmParams).
template <class Element>
struct StatsArguments {
  const Element* bias = nullptr;     // [cols] or nullptr
  const int64_t* target = nullptr;   // [rows] global class ids
  float* target_logit = nullptr;     // [rows]
  float* partials = nullptr;         // [rows, num_col_tiles, 4], or [rows, num_col_tiles, 2] without logit_sum
  int64_t class_start = 0;
  int64_t num_col_tiles = 0;
  float softcap = 0.f;
  float inv_softcap = 0.f;  // 1 / softcap, computed on the host
  bool logit_sum = true;  // fold the logit sums (label smoothing needs them); false: (max, sum) partials
  // [rows] each row's max over the chunks folded before, or nullptr: the 128 x 192 tile without bias then
  // takes fold_ref() (gemm.h's stats_ref_applies; no logits stored), partials (ref, sum exp(z - ref)).
  const float* reference = nullptr;
  // The float32 accumulator is the logit (StatsGemmParams::exact: no bias, softcap, logit sums or stored
  // logits, and the host runs the 128 x 192 tile for it): fold_exact() / fold_ref<.., true>.
  bool exact = false;
};

// The target logits this thread holds, and the quad's partial of each row (the lane with lane % 4 == 0).
template <class Element, class Rows, int kRows>
CUTLASS_DEVICE void write_rows(StatsArguments<Element> const& params, Rows const& f, int M, const bool (&mine)[kRows],
                               const float (&t_z)[kRows], const float (&m)[kRows], const float (&s)[kRows],
                               const float (&sum)[kRows], int64_t n_coord) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    if (f.row[i] >= M) continue;
    if (mine[i]) params.target_logit[f.row[i]] = t_z[i];
    if (lane % 4 == 0) {
      // Without the logit sums a partial is 8 bytes: half the partials' traffic (xc6M: 1.5 of 3 GB written
      // and read again by the merge). The branch is uniform (a kernel argument).
      const int64_t at = static_cast<int64_t>(f.row[i]) * params.num_col_tiles + n_coord;
      if (params.logit_sum) reinterpret_cast<float4*>(params.partials)[at] = make_float4(m[i], s[i], sum[i], 0.f);
      else reinterpret_cast<float2*>(params.partials)[at] = make_float2(m[i], s[i]);
    }
  }
}

// fold()'s arithmetic without softcap and logit sums (kCap, kSum false) on the logits packed two to a
// register (LogitPair): the same maxes and exps added in the same order, so the same bits (checked against
// the 128-column tiles where a row's columns fit one tile of both: tests/test_gemm.py). Columns past the
// problem (!kFull) are packed as -inf, which the max ignores and whose exps add +0.
template <bool kFull, bool kBias, bool kInPlace, class Element, class Acc, class Coords, class Rows,
          class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL>
CUTLASS_DEVICE void fold_pairs(StatsArguments<Element> const& params, Acc& acc, Coords const& tCcD, Rows const& f,
                               ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const&,
                               BlockCoordMNKL const& blk_coord_mnkl) {
  using namespace cute;
  using P = LogitPair<Element>;
  using FrgLayout = typename Acc::layout_type;
  constexpr int kSteps = size<0, 2>(FrgLayout{});
  constexpr int kRows = 2 * size<1>(FrgLayout{});
  constexpr int kTileN = size<1>(BlockShapeMNK{});
  static_assert(size<2>(FrgLayout{}) == 1, "one MMA atom spans the tile's columns (the target's offsets)");
  static_assert(kRows == 4, "fold()'s chains of four rows (its kSplit is false)");
  const int M = static_cast<int>(get<0>(problem_shape_mnkl));
  const int N = static_cast<int>(get<1>(problem_shape_mnkl));
  // kFull || the column is inside the problem: (c, st)'s column, the same for all of the thread's rows.
  auto ok = [&](int c, int st) { return kFull || get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, 0))) < N; };

  // z = acc (+ bias) rounded to Element, two columns of a row to a register (logits_in_place's values).
  typename P::Pair h[kSteps][kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int st = 0; st < kSteps; ++st) {
    float b[2] = {0.f, 0.f};
    if constexpr (kBias) {
      // logits_in_place's bias loop, with its bounds test as ok() (its form matters to ptxas here: the
      // same loop through a helper shared with logits_in_place spilled 16 bytes a thread).
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {
        const int col = get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, 0)));
        b[c] = (params.bias != nullptr && ok(c, st)) ? static_cast<float>(params.bias[col]) : 0.f;
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float a0 = acc(make_coord(make_coord(0, i % 2, st), i / 2, 0));
      float a1 = acc(make_coord(make_coord(1, i % 2, st), i / 2, 0));
      if constexpr (kBias) {
        a0 += b[0];
        a1 += b[1];
      }
      h[st][i] = P::pack(ok(0, st) ? a0 : -INFINITY, ok(1, st) ? a1 : -INFINITY);
    }
  }
  // The targets' loads after the packing (fewer registers live beside the accumulators); the max and exp
  // loops then give them time to arrive.
  int64_t target[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) target[i] = f.row[i] < M ? params.target[f.row[i]] : int64_t(-1);

  typename P::Pair hm[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) hm[i] = P::pack(-INFINITY, -INFINITY);
  CUTLASS_PRAGMA_UNROLL
  for (int st = 0; st < kSteps; ++st) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) hm[i] = P::max(hm[i], h[st][i]);
  }
  float m[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) m[i] = ::fmaxf(P::lo(hm[i]), P::hi(hm[i]));
  CUTLASS_PRAGMA_UNROLL
  for (int off = 1; off < 4; off *= 2) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) m[i] = ::fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], off));
  }
  float m0[kRows], s[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    m0[i] = (m[i] == -INFINITY ? 0.f : m[i]) * kLog2e;
    s[i] = 0.f;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int st = 0; st < kSteps; ++st) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 2; ++c) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float z = c == 0 ? P::lo(h[st][i]) : P::hi(h[st][i]);
        // A column past the problem holds -inf, whose exp is +0 whatever m0 (finite, or +inf: never -inf
        // nor NaN while the max ignores NaNs): adding it leaves s's bits as fold()'s select does, without
        // the per-column predicates (kept for all 48 steps of a 192-column tile, they spilled).
        s[i] += exp_minus(z, m0[i]);
        // kInPlace: z back into the accumulators as the pairs are last read (the pairs die as they fill).
        if constexpr (kInPlace) acc(make_coord(make_coord(c, i % 2, st), i / 2, 0)) = z;
      }
    }
  }
  // fold() adds sb (+0 with four rows) here: s + 0 is s, so that add is left out.
  CUTLASS_PRAGMA_UNROLL
  for (int off = 1; off < 4; off *= 2) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], off);
  }
  // The target logits (pick_at_offsets on the pairs): a uniform branch where a lane of the warp holds one.
  int t_off[kRows];
  bool mine[kRows], any_mine = false;
  float t_z[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    t_off[i] = target_offset<kTileN>(target[i], params.class_start, f.col0);
    mine[i] = f.row[i] < M && holds_offset<kSteps>(tCcD, t_off[i], f.col0, N);
    any_mine |= mine[i];
    t_z[i] = 0.f;
  }
  if (__any_sync(0xffffffffu, any_mine)) {
    CUTLASS_PRAGMA_UNROLL
    for (int st = 0; st < kSteps; ++st) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {
        const int offset = get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, 0))) - f.col0;  // a constant
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) {
          const float v = kInPlace ? acc(make_coord(make_coord(c, i % 2, st), i / 2, 0))
                                   : (c == 0 ? P::lo(h[st][i]) : P::hi(h[st][i]));
          t_z[i] = offset == t_off[i] ? v : t_z[i];
        }
      }
    }
  }
  const float no_sums[kRows] = {};  // (max, sum) partials: params.logit_sum is false here
  write_rows(params, f, M, mine, t_z, m, s, no_sums, static_cast<int64_t>(get<1>(blk_coord_mnkl)));
}

// The target logits of the rows whose target is one of this thread's elements (a uniform branch where a lane
// of the warp holds one), from the accumulators as they are, rounded to Element first where kRound, written
// at once (fold_ref / fold_exact: nothing of the pick stays live beside their exponent loop).
template <bool kRound, class Element, class Acc, class Coords, class Rows>
CUTLASS_DEVICE void write_target_logits(StatsArguments<Element> const& params, Acc& acc, Coords const& tCcD,
                                        Rows const& f, int M, int N) {
  using FrgLayout = typename Acc::layout_type;
  constexpr int kSteps = cute::size<0, 2>(FrgLayout{});
  constexpr int kRows = 2 * cute::size<1>(FrgLayout{});
  constexpr int kTileN = kSteps * 8;  // one MMA atom spans the tile's columns (fold_ref / fold_exact assert it)
  int t_off[kRows];
  bool mine[kRows];
  float t_z[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const bool in = f.row[i] < M;
    t_off[i] = target_offset<kTileN>(in ? params.target[f.row[i]] : int64_t(-1), params.class_start, f.col0);
    mine[i] = in && holds_offset<kSteps>(tCcD, t_off[i], f.col0, N);
    t_z[i] = 0.f;
  }
  if (!pick_at_offsets(acc, tCcD, f.col0, t_off, mine, t_z)) return;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    if (mine[i]) params.target_logit[f.row[i]] = kRound ? static_cast<float>(static_cast<Element>(t_z[i])) : t_z[i];
  }
}

// The fold against a reference (params.reference: each row's max over the chunks folded before, which the loop
// passes for the chunks after its first): the same z as fold_pairs() (the accumulators rounded to Element, one
// cvt a pair) and sum exp(z - ref) per row, no max -- so no max pass over the tile, no max shuffles and no
// packed pairs held -- into partials (ref, sum) as stats_ref_gemm.cuh's TMA kernel writes them (lse_merge then
// leaves the row max at ref). A partial past kFlagSum (a logit ~55 above ref, or a row with no finite ref) is
// folded again exactly by the merge kernel. Not the bits of fold_pairs(): the exponents subtract another max.
// kExact: z is the float32 accumulator as it is (params.exact), no pair rounded.
template <bool kFull, bool kExact, class Element, class Acc, class Coords, class Rows, class ProblemShapeMNKL,
          class BlockShapeMNK, class BlockCoordMNKL>
CUTLASS_DEVICE void fold_ref(StatsArguments<Element> const& params, Acc& acc, Coords const& tCcD, Rows const& f,
                             ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const&,
                             BlockCoordMNKL const& blk_coord_mnkl) {
  using namespace cute;
  using P = LogitPair<Element>;
  using FrgLayout = typename Acc::layout_type;
  constexpr int kSteps = size<0, 2>(FrgLayout{});
  constexpr int kRows = 2 * size<1>(FrgLayout{});
  static_assert(size<2>(FrgLayout{}) == 1, "one MMA atom spans the tile's columns (the target's offsets)");
  const int M = static_cast<int>(get<0>(problem_shape_mnkl));
  const int N = static_cast<int>(get<1>(problem_shape_mnkl));
  auto ok = [&](int c, int st) { return kFull || get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, 0))) < N; };
  // The target logits first (rounded as the pairs below round them, unless kExact): the exponent loop then lets
  // each accumulator die as it reads it (holding z back in the accumulators for a pick after spilled 20 bytes).
  write_target_logits<!kExact>(params, acc, tCcD, f, M, N);
  float refl[kRows], s[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    refl[i] = (f.row[i] < M ? params.reference[f.row[i]] : 0.f) * kLog2e;
    s[i] = 0.f;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int st = 0; st < kSteps; ++st) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float a0 = acc(make_coord(make_coord(0, i % 2, st), i / 2, 0));
      const float a1 = acc(make_coord(make_coord(1, i % 2, st), i / 2, 0));
      float z0 = a0, z1 = a1;
      if constexpr (!kExact) {
        const typename P::Pair h = P::pack(a0, a1);
        z0 = P::lo(h);
        z1 = P::hi(h);
      }
      // A column past the problem (the TMA loads' zero fill) would add exp(-ref): masked.
      s[i] += ok(0, st) ? exp_minus(z0, refl[i]) : 0.f;
      s[i] += ok(1, st) ? exp_minus(z1, refl[i]) : 0.f;
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int off = 1; off < 4; off *= 2) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], off);
  }
  // The partials carry the reference itself (read again: a cached load, four registers fewer in the loop).
  float ref[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) ref[i] = f.row[i] < M ? params.reference[f.row[i]] : 0.f;
  const float no_sums[kRows] = {};
  const bool none[kRows] = {};  // (the target logits are written above)
  write_rows(params, f, M, none, no_sums, ref, s, no_sums, static_cast<int64_t>(get<1>(blk_coord_mnkl)));
}

// The fold with z the float32 accumulator (params.exact), in one pass: each partial is taken against m, the
// row's max over the tile's first eight columns (the quad's first step, two xor shuffles), not the tile's max,
// so nothing holds the accumulators for a second pass (a max pass over all 192 spilled 42 bytes a thread) and
// an element is one FFMA, one MUFU.EX2 and one FADD. The partial (m, sum exp(z - m)) is as good as any for
// lse_merge while no logit of the tile lies ~55 above m: a sum past kFlagSum (gemm.h) is folded again exactly
// by the merge kernel (the host gives it the operands for exact calls).
template <bool kFull, class Element, class Acc, class Coords, class Rows, class ProblemShapeMNKL, class BlockShapeMNK,
          class BlockCoordMNKL>
CUTLASS_DEVICE void fold_exact(StatsArguments<Element> const& params, Acc& acc, Coords const& tCcD, Rows const& f,
                               ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const&,
                               BlockCoordMNKL const& blk_coord_mnkl) {
  using namespace cute;
  using FrgLayout = typename Acc::layout_type;
  constexpr int kSteps = size<0, 2>(FrgLayout{});
  constexpr int kRows = 2 * size<1>(FrgLayout{});
  static_assert(size<2>(FrgLayout{}) == 1, "one MMA atom spans the tile's columns (the target's offsets)");
  const int M = static_cast<int>(get<0>(problem_shape_mnkl));
  const int N = static_cast<int>(get<1>(problem_shape_mnkl));
  auto ok = [&](int c, int st) { return kFull || get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, 0))) < N; };
  write_target_logits<false>(params, acc, tCcD, f, M, N);  // (first: nothing of the pick stays live through the pass)
  float m[kRows], m0[kRows], s[kRows];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float a0 = acc(make_coord(make_coord(0, i % 2, 0), i / 2, 0));
    const float a1 = acc(make_coord(make_coord(1, i % 2, 0), i / 2, 0));
    m[i] = ::fmaxf(ok(0, 0) ? a0 : -INFINITY, ok(1, 0) ? a1 : -INFINITY);  // NaN-ignoring, as fmaxf is
  }
  CUTLASS_PRAGMA_UNROLL
  for (int off = 1; off < 4; off *= 2) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) m[i] = ::fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], off));
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) {
    m[i] = m[i] == -INFINITY ? 0.f : m[i];  // (no finite sample: exps against 0, flagged if they overflow)
    m0[i] = m[i] * kLog2e;
    s[i] = 0.f;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int st = 0; st < kSteps; ++st) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 2; ++c) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float e = exp_minus(acc(make_coord(make_coord(c, i % 2, st), i / 2, 0)), m0[i]);
        s[i] += ok(c, st) ? e : 0.f;
      }
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int off = 1; off < 4; off *= 2) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) s[i] += __shfl_xor_sync(0xffffffffu, s[i], off);
  }
  const float no_sums[kRows] = {};
  const bool none[kRows] = {};  // (the target logits are written above)
  write_rows(params, f, M, none, no_sums, m, s, no_sums, static_cast<int64_t>(get<1>(blk_coord_mnkl)));
}

}  // namespace gemm
}  // namespace hugehead
