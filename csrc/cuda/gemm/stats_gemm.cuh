// The logits GEMM whose epilogue folds each (row, column tile) of z = x W^T + b into partial online
// log-sum-exp statistics instead of storing z: a CUTLASS sm_90a warp-specialized TMA mainloop (from the
// collective builder) under GemmUniversal, with our own register-only epilogue (the kind CUTLASS's
// DefaultEpilogue is, wrapped by Sm90TmaWarpSpecializedAdapter). Included by one .cu per (dtype,
// schedule) so the instantiations compile in parallel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <cmath>
#include <cstdint>

#include "hugehead/gemm.h"

namespace hugehead {
namespace gemm {

// Epilogue of the statistics GEMM. The accumulator of a warpgroup MMA (wgmma) is laid out per thread as
// ((2, 2, N/8), MMA_M, MMA_N): mode 0's first 2 are adjacent columns, its second 2 are rows r and r + 8,
// its last N/8 are 8-column steps. In that layout every row of the tile is held by the four lanes of one
// quad of one warp (lane / 4 picks the row, lane % 4 the column pair), and a tile's warpgroups split it
// along M only (the collective builder's atom layouts are 1x1 or 2x1). So a row's statistics over the
// tile are: the thread's own columns, then two xor shuffles inside the quad; no shared memory, and the
// lane with lane % 4 == 0 writes the row's partial. Row and column indices come from the identity tensor
// partitioned like the accumulator, so the only assumption is which lanes share a row.
template <class Element>
struct StatsEpilogue {
  using ElementC = Element;  // no C or D is read or written; the kernel only names these types
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ThreadEpilogueOp = void;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};

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
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.target != nullptr && args.target_logit != nullptr && args.partials != nullptr;
  }

  CUTLASS_HOST_DEVICE StatsEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected a wgmma accumulator");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected a wgmma accumulator");
    static_assert(size<2>(typename TiledMma::ThrLayoutVMNK{}) == 1,
                  "warpgroups must split the tile along M only: a row's columns stay in one quad");
    constexpr int kSteps = size<0, 2>(FrgLayout{});  // 8-column steps per MMA atom
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});

    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));
    const auto m_coord = get<0>(blk_coord_mnkl);
    const auto n_coord = get<1>(blk_coord_mnkl);
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    Tensor tCcD = thr_mma.partition_C(cD);  // (MMA, MMA_M, MMA_N) -> (row, col) in the chunk
    const float cap = params.softcap;
    // z * (1 / cap), not z / cap: an IEEE division is a called subroutine, and any call inside the
    // kernel serializes the wgmma pipeline.
    const float inv_cap = cap > 0.f ? __frcp_rn(cap) : 0.f;
    const bool has_bias = params.bias != nullptr;

    // Pass 1, in place: z = acc + bias, softcapped. A column's bias is read once for all of the thread's
    // rows. Everything stays in the accumulator registers (no per-row copies: they spilled).
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 0; ni < kMmaN; ++ni) {
      CUTLASS_PRAGMA_UNROLL
      for (int st = 0; st < kSteps; ++st) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const int col = get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, ni)));
          const float b = (has_bias && col < N) ? static_cast<float>(params.bias[col]) : 0.f;
          CUTLASS_PRAGMA_UNROLL
          for (int mi = 0; mi < kMmaM; ++mi) {
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r) {
              float z = static_cast<float>(acc(make_coord(make_coord(c, r, st), mi, ni))) + b;
              if (cap > 0.f) z = cap * ::tanhf(z * inv_cap);
              acc(make_coord(make_coord(c, r, st), mi, ni)) = z;
            }
          }
        }
      }
    }

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

template <Schedule S>
struct ScheduleConfig;
// Pingpong: two consumer warpgroups on alternate tiles, so one's epilogue (the exps) runs while the
// other's MMAs do.
template <>
struct ScheduleConfig<Schedule::kPingpong> {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
};
// Cooperative: both warpgroups on one 128 x 256 tile (half the partials, no epilogue overlap).
template <>
struct ScheduleConfig<Schedule::kCooperative> {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
};

template <class Element, Schedule S>
struct StatsGemm {
  using Config = ScheduleConfig<S>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<StatsEpilogue<Element>>;
  static constexpr int kAlign = 16 / sizeof(Element);
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, typename Config::Tile, cute::Shape<cute::_1, cute::_1, cute::_1>,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Device::Arguments arguments(const StatsGemmParams& p) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    StrideA stride_a{p.x_stride, cute::Int<1>{}, p.x_stride * p.rows};
    StrideB stride_b{p.weight_stride, cute::Int<1>{}, p.weight_stride * p.cols};
    typename StatsEpilogue<Element>::Arguments epi;
    epi.bias = static_cast<const Element*>(p.bias);
    epi.target = p.target;
    epi.target_logit = p.target_logit;
    epi.partials = p.partials;
    epi.class_start = p.class_start;
    epi.num_col_tiles = (p.cols + cute::size<1>(typename Config::Tile{}) - 1) / cute::size<1>(typename Config::Tile{});
    epi.softcap = p.softcap;
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = p.sm_count;
    return typename Device::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(p.rows), static_cast<int>(p.cols), static_cast<int>(p.depth), 1},
        {static_cast<const Element*>(p.x), stride_a, static_cast<const Element*>(p.weight), stride_b},
        epi,
        hw};
  }

  static size_t workspace_bytes(const StatsGemmParams& p) { return Device::get_workspace_size(arguments(p)); }

  static const char* run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {
    Device gemm;
    const auto args = arguments(p);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return "CUTLASS cannot implement this statistics GEMM (alignment of x / weight / strides?)";
    }
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
      return "CUTLASS failed to initialize the statistics GEMM";
    }
    if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS failed to launch the statistics GEMM";
    return nullptr;
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
