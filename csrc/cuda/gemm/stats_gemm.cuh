// The logits GEMM whose epilogue folds each (row, column tile) of z = x W^T + b into partial online
// log-sum-exp statistics instead of storing z (the GEMM itself: fused_gemm.cuh). Included by one .cu per
// (dtype, schedule) so the instantiations compile in parallel.
#pragma once

#include <cmath>
#include <cstdint>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

// Epilogue of the statistics GEMM (fragment layout: fused_gemm.cuh). A row's statistics over the tile are
// the thread's own columns, then two xor shuffles inside the quad that holds the row; no shared memory, and
// the lane with lane % 4 == 0 writes the row's partial.
template <class Element>
struct StatsEpilogue : EpilogueBase<Element> {
  struct Arguments {
    const Element* bias = nullptr;     // [cols] or nullptr
    const int64_t* target = nullptr;   // [rows] global class ids
    float* target_logit = nullptr;     // [rows]
    float* partials = nullptr;         // [rows, num_col_tiles, 4]
    int64_t class_start = 0;
    int64_t num_col_tiles = 0;
    float softcap = 0.f;
  };
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
    using namespace cute;
    check_fragment<FrgLayout, TiledMma>();
    constexpr int kSteps = size<0, 2>(FrgLayout{});  // 8-column steps per MMA atom
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});

    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));
    const auto n_coord = get<1>(blk_coord_mnkl);
    const auto tCcD = tile_coordinates(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);
    logits_in_place<Element>(acc, tCcD, N, params.bias, params.softcap);

    const int lane = static_cast<int>(threadIdx.x) % 32;
    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < kMmaM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = get<0>(tCcD(make_coord(make_coord(0, r, 0), mi, 0)));
        const bool row_ok = row < M;
        const int64_t t = row_ok ? params.target[row] - params.class_start : int64_t(-1);
        // Pass 2: the row's max over this thread's in-range columns, its logit sum, its target logit.
        float m = -INFINITY, sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kMmaN; ++ni) {
          CUTLASS_PRAGMA_UNROLL
          for (int st = 0; st < kSteps; ++st) {
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              const int col = get<1>(tCcD(make_coord(make_coord(c, r, st), mi, ni)));
              const float z = acc(make_coord(make_coord(c, r, st), mi, ni));
              const bool ok = col < N;
              if (ok && col == t) params.target_logit[row] = z;
              sum += ok ? z : 0.f;
              m = ::fmaxf(m, ok ? z : -INFINITY);  // NaN-ignoring: a NaN reaches s through its exp below
            }
          }
        }
        // Pass 3: one exp per element, as chunk_stats_'s fold_values (while the max is -inf, NaNs are
        // summed as they are, so a NaN still surfaces).
        float s = 0.f;
        const bool all_neg_inf = m == -INFINITY;
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kMmaN; ++ni) {
          CUTLASS_PRAGMA_UNROLL
          for (int st = 0; st < kSteps; ++st) {
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              const int col = get<1>(tCcD(make_coord(make_coord(c, r, st), mi, ni)));
              const float z = acc(make_coord(make_coord(c, r, st), mi, ni));
              if (col < N) s += all_neg_inf ? (z != z ? z : 0.f) : __expf(z - m);
            }
          }
        }
        // The quad holding this row: xor shuffles give all four lanes the same (commutative) result.
        CUTLASS_PRAGMA_UNROLL
        for (int off = 1; off < 4; off *= 2) {
          const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
          const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
          sum += __shfl_xor_sync(0xffffffffu, sum, off);
          const float mm = ::fmaxf(m, m2);
          s = (m == -INFINITY ? 0.f * s : s * __expf(m - mm)) + (m2 == -INFINITY ? 0.f * s2 : s2 * __expf(m2 - mm));
          m = mm;  // never NaN: fmaxf from -inf ignores NaN values
        }
        if (row_ok && lane % 4 == 0) {
          const float4 part = make_float4(m, s, sum, 0.f);
          reinterpret_cast<float4*>(params.partials)[static_cast<int64_t>(row) * params.num_col_tiles + n_coord] = part;
        }
      }
    }
  }

  Params params;
};

template <class Element, Schedule S>
struct StatsGemm {
  using Gemm = FusedGemm<Element, S, StatsEpilogue<Element>>;

  static typename Gemm::Device::Arguments arguments(const StatsGemmParams& p) {
    typename StatsEpilogue<Element>::Arguments epi;
    epi.bias = static_cast<const Element*>(p.bias);
    epi.target = p.target;
    epi.target_logit = p.target_logit;
    epi.partials = p.partials;
    epi.class_start = p.class_start;
    epi.num_col_tiles = (p.cols + Gemm::kTileCols - 1) / Gemm::kTileCols;
    epi.softcap = p.softcap;
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth, epi, p.sm_count);
  }
  static size_t workspace_bytes(const StatsGemmParams& p) { return Gemm::Device::get_workspace_size(arguments(p)); }
  static const char* run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {
    return Gemm::run(arguments(p), workspace, stream);
  }
};

}  // namespace gemm
}  // namespace hugehead

// One explicit instantiation per .cu: the launcher functions that stats_gemm_dispatch.cu calls.
#define HUGEHEAD_STATS_GEMM_INSTANCE(NAME, ELEMENT, SCHEDULE)                                                   \
  namespace hugehead {                                                                                       \
  namespace gemm {                                                                                           \
  size_t NAME##_workspace(const StatsGemmParams& p) { return StatsGemm<ELEMENT, SCHEDULE>::workspace_bytes(p); } \
  const char* NAME##_run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {                   \
    return StatsGemm<ELEMENT, SCHEDULE>::run(p, workspace, stream);                                          \
  }                                                                                                          \
  }                                                                                                          \
  }
