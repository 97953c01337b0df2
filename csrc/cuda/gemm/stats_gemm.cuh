// The logits GEMM whose epilogue folds each (row, column tile) of z = x W^T + b into partial online
// log-sum-exp statistics instead of storing z (the GEMM itself: fused_gemm.cuh). Included by one .cu per
// (dtype, schedule) so the instantiations compile in parallel.
#pragma once

#include <cmath>
#include <cstdint>

#include "stats_folds.cuh"

namespace hugehead {
namespace gemm {

// Epilogue of the statistics GEMM (fragment layout and why it is written this way: fused_gemm.cuh). A
// row's statistics over the tile are the thread's own columns, then two xor shuffles inside the quad that
// holds the row; no shared memory, and the lane with lane % 4 == 0 writes the row's partial.
//
// Two folds with the same arithmetic in the same order (so the same bits): fold() rounds the accumulators to
// z in place (what the GEMM that also stores z needs: stats_store_gemm.cuh), and fold_pairs(),
// the 128 x 192 tile's, packs them two to a register first: its 192 accumulators a thread leave fold() too
// few registers (ptxas spills there; fold_pairs() does not, without logit sums). On 128-column tiles
// fold_pairs() is the slower one (it spills more than fold() there), so they keep fold().
template <class Element>
struct StatsEpilogue : EpilogueBase<Element> {
  using Arguments = StatsArguments<Element>;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.target != nullptr && args.target_logit != nullptr && args.partials != nullptr;
  }

  CUTLASS_HOST_DEVICE StatsEpilogue(Params const& p, typename EpilogueBase<Element>::SharedStorage const& = {})
      : params(p) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    fold_tile<false>(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl, acc, tiled_mma, thread_idx);
  }

  // kInPlace: the accumulators leave as z (acc + bias rounded to Element, exact in float) for a TMA store of
  // them after (stats_store_gemm.cuh): fold() always leaves them so, fold_pairs() only when asked.
  template <bool kInPlace, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma>
  CUTLASS_DEVICE void fold_tile(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                TiledMma tiled_mma, int thread_idx) {
    using namespace cute;
    check_fragment<FrgLayout, TiledMma>();
    if (tile_past_columns(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl)) return;
    constexpr int kRows = 2 * size<1>(FrgLayout{});
    // The 128 x 192 tile has fold_pairs() only; its launches have no softcap and no logit sums
    // (stats_schedule_for picks another schedule for those).
    constexpr bool kPairsOnly = size<1>(BlockShapeMNK{}) == 192;
    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    opaque_per_tile(thread_idx);
    const auto tCcD = tile_coordinates(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);
    const auto f = fragment_rows<FrgLayout>(tCcD, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
    if constexpr (kPairsOnly) {
      if (!kInPlace && params.reference != nullptr) {  // (no bias: stats_ref_applies)
        if (params.exact) {
          if (f.full) fold_ref<true, true>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
          else fold_ref<false, true>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
        } else {
          if (f.full) fold_ref<true, false>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
          else fold_ref<false, false>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
        }
      } else if (!kInPlace && params.exact) {  // (no bias: the host's rule)
        if (f.full) fold_exact<true>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
        else fold_exact<false>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
      } else if (!f.full) {
        fold_pairs<false, true, kInPlace>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
      } else if (params.bias != nullptr) {
        fold_pairs<true, true, kInPlace>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
      } else {
        fold_pairs<true, false, kInPlace>(params, acc, tCcD, f, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
      }
    }
    if constexpr (!kPairsOnly) {
      const bool cap = params.softcap > 0.f;
      int64_t target[kRows];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) target[i] = f.row[i] < M ? params.target[f.row[i]] : int64_t(-1);
      // Fast paths for the tiles inside the problem without softcap; every other tile takes a checked path.
      // The logit sums only serve label smoothing: without it (params.logit_sum false) the fast path skips
      // them (a partial's sum is then 0, and logit_sum is left as it was).
      if (f.full && !cap) {
        if (params.logit_sum) {
          if (params.bias != nullptr) fold<true, false, true, true>(acc, tCcD, f, target, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
          else fold<true, false, false, true>(acc, tCcD, f, target, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
        } else {
          if (params.bias != nullptr) fold<true, false, true, false>(acc, tCcD, f, target, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
          else fold<true, false, false, false>(acc, tCcD, f, target, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
        }
      } else {
        if (cap) fold<false, true, true, true>(acc, tCcD, f, target, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
        else fold<false, false, true, true>(acc, tCcD, f, target, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
      }
    }
  }

  // kSum: fold the logit sums (else their partial is 0; the checked path always folds them).
  template <bool kFull, bool kCap, bool kBias, bool kSum, class Acc, class Coords, class Rows, int kRows, class ProblemShapeMNKL,
            class BlockShapeMNK, class BlockCoordMNKL>
  CUTLASS_DEVICE void fold(Acc& acc, Coords const& tCcD, Rows const& f, const int64_t (&target)[kRows],
                           ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const&,
                           BlockCoordMNKL const& blk_coord_mnkl) {
    using namespace cute;
    using FrgLayout = typename Acc::layout_type;
    constexpr int kSteps = size<0, 2>(FrgLayout{});  // 8-column steps per MMA atom
    constexpr int kMmaN = size<2>(FrgLayout{});
    constexpr int kTileN = size<1>(BlockShapeMNK{});
    static_assert(kMmaN == 1, "one MMA atom spans the tile's columns (the target's element is found from that)");
    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));
    logits_in_place<Element, kFull, kCap, kBias>(acc, tCcD, N, params.bias, params.softcap, params.inv_softcap);

    // Each row's max over the quad's 128 columns first (two partial maxes per row, so the thread's rows
    // give eight independent chains; fmaxf is exact in any order), shared by the quad's four lanes by two
    // xor shuffles. Every exponent then subtracts the same max, so the quad's sums add with no rescale:
    // no exp in the reduction (a per-lane (max, sum) merge would be a large share of a tile's instructions).
    // kSplit: two partial maxes and sums per row where the thread has fewer than four rows.
    constexpr bool kSplit = kRows < 4;
    float m[kRows], mb[kRows], sum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      m[i] = -INFINITY;
      mb[i] = -INFINITY;
      sum[i] = 0.f;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 0; ni < kMmaN; ++ni) {
      CUTLASS_PRAGMA_UNROLL
      for (int st = 0; st < kSteps; ++st) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const int col = get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, ni)));
          const bool ok = kFull || col < N;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kRows; ++i) {
            const float z = acc(make_coord(make_coord(c, i % 2, st), i / 2, ni));
            if constexpr (kSum) sum[i] += ok ? z : 0.f;
            // NaN-ignoring: a NaN reaches s through its exp below.
            if (!kSplit || st % 2 == 0) m[i] = ::fmaxf(m[i], ok ? z : -INFINITY);
            else mb[i] = ::fmaxf(mb[i], ok ? z : -INFINITY);
          }
        }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) m[i] = ::fmaxf(m[i], mb[i]);
    CUTLASS_PRAGMA_UNROLL
    for (int off = 1; off < 4; off *= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) m[i] = ::fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], off));
    }
    // One exp per element, as chunk_stats_'s fold_values (up to exp_minus's rounding and flushed terms). A
    // row whose max is -inf (all -inf or NaN) takes exp(z - 0): 0 for -inf, NaN for NaN, so a NaN still
    // surfaces, as there. Two partial sums per row (independent chains), added at the end.
    float m0[kRows];  // log2(e) times the max each exponent subtracts
    float s[kRows], sb[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      m0[i] = (m[i] == -INFINITY ? 0.f : m[i]) * kLog2e;
      s[i] = 0.f;
      sb[i] = 0.f;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 0; ni < kMmaN; ++ni) {
      CUTLASS_PRAGMA_UNROLL
      for (int st = 0; st < kSteps; ++st) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const bool ok = kFull || get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, ni))) < N;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kRows; ++i) {
            const float e = exp_minus(acc(make_coord(make_coord(c, i % 2, st), i / 2, ni)), m0[i]);
            if (!kSplit || st % 2 == 0) s[i] += ok ? e : 0.f;
            else sb[i] += ok ? e : 0.f;
          }
        }
      }
    }
    // The quad's sums: xor shuffles give all four lanes the same bits (each add is commutative).
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) s[i] += sb[i];
    CUTLASS_PRAGMA_UNROLL
    for (int off = 1; off < 4; off *= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        s[i] += __shfl_xor_sync(0xffffffffu, s[i], off);
        if constexpr (kSum) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], off);
      }
    }
    // The target logits last, so the targets' loads (issued first thing in operator()) have had the whole
    // fold to arrive; picked under a warp vote (fused_gemm.cuh).
    int t_off[kRows];
    bool mine[kRows];
    float t_z[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      t_off[i] = target_offset<kTileN>(target[i], params.class_start, f.col0);
      mine[i] = f.row[i] < M && holds_offset<kSteps>(tCcD, t_off[i], f.col0, N);
      t_z[i] = 0.f;
    }
    pick_at_offsets(acc, tCcD, f.col0, t_off, mine, t_z);
    write_rows(params, f, M, mine, t_z, m, s, sum, static_cast<int64_t>(get<1>(blk_coord_mnkl)));
  }

  Params params;
};

// The statistics epilogue's arguments for a launch (shared with stats_store_gemm.cuh), tiles kTileCols wide.
template <class Element>
typename StatsEpilogue<Element>::Arguments stats_epilogue_arguments(const StatsGemmParams& p, int tile_cols) {
  typename StatsEpilogue<Element>::Arguments epi;
  epi.bias = static_cast<const Element*>(p.bias);
  epi.target = p.target;
  epi.target_logit = p.target_logit;
  epi.partials = p.partials;
  epi.class_start = p.class_start;
  epi.num_col_tiles = (p.cols + tile_cols - 1) / tile_cols;
  epi.softcap = p.softcap;
  epi.inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
  epi.logit_sum = p.logit_sum;
  epi.reference = p.logits == nullptr ? p.reference : nullptr;  // (with logits the reference is the TMA kernel's)
  epi.exact = p.exact;
  return epi;
}

template <class Element, Schedule S>
struct StatsGemm {
  using Gemm = FusedGemm<Element, S, StatsEpilogue<Element>>;

  static typename Gemm::Device::Arguments arguments(const StatsGemmParams& p) {
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth,
                           stats_epilogue_arguments<Element>(p, Gemm::kTileCols), p.sm_count);
  }
  static size_t workspace_bytes(const StatsGemmParams& p) { return Gemm::Device::get_workspace_size(arguments(p)); }
  static const char* run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {
    return Gemm::run(arguments(p), workspace, stream);
  }
};

}  // namespace gemm
}  // namespace hugehead
