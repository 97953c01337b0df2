// The GEMM every fused kernel of csrc/cuda/gemm/ shares: z = x W^T with x [rows, depth] and W [cols, depth]
// both K-major (a TN GEMM), a CUTLASS sm_90a warp-specialized TMA mainloop from the collective builder under
// GemmUniversal (persistent tile scheduler), and an epilogue of ours of the register-only kind CUTLASS's
// DefaultEpilogue is (wrapped by Sm90TmaWarpSpecializedAdapter): it gets the float32 accumulator fragment
// and the tiled MMA, and never stores z.
//
// Fragment layout the epilogues rely on (static_asserts check its shape): a warpgroup MMA (wgmma)
// accumulator is ((2, 2, N/8), MMA_M, MMA_N) per thread: mode 0's first 2 are adjacent columns, its second 2
// rows r and r + 8, its last N/8 8-column steps. Every row of a tile is held by the four lanes of one quad
// of one warp (lane / 4 picks the row, lane % 4 the column pair), and the builder's warpgroups split a tile
// along M only. Row and column indices come from the identity tensor partitioned like the accumulator.
//
// How fast the epilogues run decides how fast the GEMM runs: in the pingpong schedule one warpgroup's
// epilogue overlaps the other's MMAs only while it is shorter than them (a 128 x 128 x 768 tile's MMAs are
// ~6k cycles), and each scheduler then runs a single epilogue warp, so the epilogue is latency-bound. Hence
// (Nsight Compute and the SASS of the first version: ~30k cycles a tile, 10.6 cycles per instruction):
// tiles wholly inside the problem take a path without bounds checks; a thread's rows are folded
// side by side (independent dependency chains) with the column loop outside; class ids are compared as
// 32-bit offsets from the thread's first column; every global load is issued before the arithmetic.
#pragma once

#include <cuda_bf16.h>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <cstdint>
#include <type_traits>

#include "hugehead/gemm.h"
#include "hugehead/sfu_exp.cuh"

namespace hugehead {
namespace gemm {

template <Schedule S>
struct ScheduleConfig;
// Pingpong (two consumer warpgroups on alternate tiles, so one's epilogue, the exps, runs while the other's
// MMAs do) in clusters of two CTAs along M: each W tile is loaded once (TMA multicast) for both CTAs,
// a quarter less L2 traffic (a 128 x 128 tile at K = 768 reads ~0.4 MB from L2 for 25 MFLOP).
template <>
struct ScheduleConfig<Schedule::kPingpongCluster> {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
// 128 x 192 tiles in 2-CTA clusters: a sixth fewer L2 bytes a FLOP than 128 x 128, wgmma n192. The gradient
// GEMM's TMA store, and the statistics GEMM with fold_pairs() without logit sums (192 fp32 accumulators a
// thread leave its other folds too few registers: ptxas spilled ~1 KB a thread).
template <>
struct ScheduleConfig<Schedule::kPingpongCluster192> {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Tile = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
// Cooperative: both warpgroups on one 128 x 256 tile (half the partials, no epilogue overlap).
template <>
struct ScheduleConfig<Schedule::kCooperative> {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
};

// Names the kernel wants of an epilogue that reads and writes no C or D through CUTLASS, and the host-side
// hooks it calls (no workspace, nothing to initialize); an epilogue derives from this.
template <class Element>
struct EpilogueBase {
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ThreadEpilogueOp = void;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};

  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_source_needed() { return false; }
};

template <class FrgLayout, class TiledMma>
CUTLASS_DEVICE constexpr void check_fragment() {
  using namespace cute;
  static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "expected a wgmma accumulator");
  static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "expected a wgmma accumulator");
  static_assert(size<2>(typename TiledMma::ThrLayoutVMNK{}) == 1,
                "warpgroups must split the tile along M only: a row's columns stay in one quad");
}

// Makes v opaque to the compiler where this is called, once per tile: what an epilogue derives from the
// thread index (its rows and columns) is then computed again for each tile instead of being hoisted out of
// the persistent tile loop, where ptxas kept it in local memory and each tile's epilogue began by waiting
// on that reload.
CUTLASS_DEVICE void opaque_per_tile(int& v) { asm volatile("" : "+r"(v)); }

// Whether the persistent scheduler handed out a tile wholly past the chunk's columns (a grid CUTLASS padded to
// its swizzle): the statistics epilogue would write such a tile's partial into the next row's slots, so
// epilogues skip it.
template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL>
CUTLASS_DEVICE bool tile_past_columns(ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const&,
                                      BlockCoordMNKL const& blk_coord_mnkl) {
  using namespace cute;
  return static_cast<int64_t>(get<1>(blk_coord_mnkl)) * size<1>(BlockShapeMNK{}) >=
         static_cast<int64_t>(get<1>(problem_shape_mnkl));
}

// (row, column) in the chunk of each accumulator element of this thread: (MMA, MMA_M, MMA_N) like acc.
template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class TiledMma>
CUTLASS_DEVICE auto tile_coordinates(ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const& blk_shape_MNK,
                                     BlockCoordMNKL const& blk_coord_mnkl, TiledMma const& tiled_mma, int thread_idx) {
  using namespace cute;
  const int M = static_cast<int>(get<0>(problem_shape_mnkl));
  const int N = static_cast<int>(get<1>(problem_shape_mnkl));
  auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                         make_coord(get<0>(blk_coord_mnkl), get<1>(blk_coord_mnkl)));
  return thr_mma.partition_C(cD);
}

// The SFU exponentials (kLog2e, exp2_ftz, exp_ftz, exp_minus) and log2_sfu: sfu_exp.cuh, shared with chunk_stats_ / chunk_grad_.
using cuda::exp2_ftz;
using cuda::exp_ftz;
using cuda::exp_minus;
using cuda::log2_sfu;
using cuda::kLog2e;

// The tile a thread's fragment belongs to: its rows (kRows = 2 MMA_M, as the fragment's row modes), the
// chunk column of its first element, and whether the whole tile lies inside the problem (then no element
// needs a bounds check).
template <int kRows>
struct FragmentRows {
  int row[kRows];
  int col0;
  bool full;
};

template <class FrgLayout, class Coords, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL>
CUTLASS_DEVICE auto fragment_rows(Coords const& tCcD, ProblemShapeMNKL const& problem_shape_mnkl,
                                  BlockShapeMNK const&, BlockCoordMNKL const& blk_coord_mnkl) {
  using namespace cute;
  constexpr int kMmaM = size<1>(FrgLayout{});
  FragmentRows<2 * kMmaM> f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 2 * kMmaM; ++i) f.row[i] = get<0>(tCcD(make_coord(make_coord(0, i % 2, 0), i / 2, 0)));
  f.col0 = get<1>(tCcD(make_coord(make_coord(0, 0, 0), 0, 0)));
  constexpr int kTileM = size<0>(BlockShapeMNK{});
  constexpr int kTileN = size<1>(BlockShapeMNK{});
  f.full = (static_cast<int>(get<0>(blk_coord_mnkl)) + 1) * kTileM <= static_cast<int>(get<0>(problem_shape_mnkl)) &&
           (static_cast<int>(get<1>(blk_coord_mnkl)) + 1) * kTileN <= static_cast<int>(get<1>(problem_shape_mnkl));
  return f;
}

// A row's class id as an offset from the thread's first column, or -1 when it is not in this tile (so it
// matches no element: the element offsets are 0 .. kTileN - 1). 32-bit compares in the element loops.
template <int kTileN>
CUTLASS_DEVICE int target_offset(int64_t target, int64_t class_start, int col0) {
  const int64_t rel = target - class_start - col0;
  return (rel >= 0 && rel < kTileN) ? static_cast<int>(rel) : -1;
}

// In place: acc -> z = acc + bias rounded once to Element, then softcapped in float32. These are exactly
// the logits cuBLAS's addmm stores and chunk_stats_ / chunk_grad_ read (up to the GEMM's summation order),
// so the forward's lse stays consistent with the backward's recomputed logits whichever GEMM computes
// either (a float32 lse against bf16 logits would put a confident row's p_target - 1 off by the logit's
// rounding). A column's bias is read once for all of the thread's rows (no registers are left to hold
// them all: the 128 x 128 tile's accumulators take 128 of the 168). kFull: no column is outside the
// problem. kCap: softcap > 0 (inv_cap = 1 / cap from the host: a division is a called subroutine).
// kBias: bias may be set (checked); without it z is the accumulator rounded, as cuBLAS's mm stores it.
template <class Element, bool kFull, bool kCap, bool kBias, class Acc, class Coords>
CUTLASS_DEVICE void logits_in_place(Acc& acc, Coords const& tCcD, int N, const Element* bias, float cap,
                                    float inv_cap) {
  using namespace cute;
  using FrgLayout = typename Acc::layout_type;
  constexpr int kSteps = size<0, 2>(FrgLayout{});
  constexpr int kMmaM = size<1>(FrgLayout{});
  constexpr int kMmaN = size<2>(FrgLayout{});
  CUTLASS_PRAGMA_UNROLL
  for (int ni = 0; ni < kMmaN; ++ni) {
    CUTLASS_PRAGMA_UNROLL
    for (int st = 0; st < kSteps; ++st) {
      float b[2] = {0.f, 0.f};
      if constexpr (kBias) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          const int col = get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, ni)));
          b[c] = (bias != nullptr && (kFull || col < N)) ? static_cast<float>(bias[col]) : 0.f;
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int mi = 0; mi < kMmaM; ++mi) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          float a0 = acc(make_coord(make_coord(0, r, st), mi, ni));
          float a1 = acc(make_coord(make_coord(1, r, st), mi, ni));
          if constexpr (kBias) {
            a0 += b[0];
            a1 += b[1];
          }
          float z0, z1;
          if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
            // Both neighbours rounded by one cvt.rn.bf16x2 (the conversion pipe runs at a quarter of the
            // FMA pipe's rate), unpacked by integer ops.
            const __nv_bfloat162 h = __floats2bfloat162_rn(a0, a1);
            z0 = __low2float(h);
            z1 = __high2float(h);
          } else {
            z0 = static_cast<float>(static_cast<Element>(a0));
            z1 = static_cast<float>(static_cast<Element>(a1));
          }
          if constexpr (kCap) {
            z0 = cap * ::tanhf(z0 * inv_cap);
            z1 = cap * ::tanhf(z1 * inv_cap);
          }
          acc(make_coord(make_coord(0, r, st), mi, ni)) = z0;
          acc(make_coord(make_coord(1, r, st), mi, ni)) = z1;
        }
      }
    }
  }
}

// Whether row i's target column (offset t from the thread's first column, target_offset) is one of this
// thread's elements: the element at that offset is at (t % 2, t / 8) of the fragment's first atom when one
// atom spans the tile's columns (checked against the layout, not assumed).
template <int kSteps, class Coords>
CUTLASS_DEVICE bool holds_offset(Coords const& tCcD, int t, int col0, int N) {
  using namespace cute;
  return t >= 0 && (t & 7) < 2 && (t >> 3) < kSteps && col0 + t < N &&
         get<1>(tCcD(make_coord(make_coord(t & 1, 0, t >> 3), 0, 0))) - col0 == t;
}

// z[i] = the accumulator element at row i's offset t_off[i] (target_offset), for the rows whose offset is
// one of this thread's elements (mine[i], holds_offset; z[i] of the others is left as it was). A tile holds
// few rows' targets (one in V / 128 at most), so the warp picks them only when one of its lanes holds one
// (a uniform branch), instead of a compare and select per element. Returns whether the warp picked.
template <int kRows, class Acc, class Coords>
CUTLASS_DEVICE bool pick_at_offsets(Acc& acc, Coords const& tCcD, int col0, const int (&t_off)[kRows],
                                    const bool (&mine)[kRows], float (&z)[kRows]) {
  using namespace cute;
  using FrgLayout = typename Acc::layout_type;
  constexpr int kSteps = size<0, 2>(FrgLayout{});
  constexpr int kMmaN = size<2>(FrgLayout{});
  bool any_mine = false;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kRows; ++i) any_mine |= mine[i];
  if (!__any_sync(0xffffffffu, any_mine)) return false;
  CUTLASS_PRAGMA_UNROLL
  for (int ni = 0; ni < kMmaN; ++ni) {
    CUTLASS_PRAGMA_UNROLL
    for (int st = 0; st < kSteps; ++st) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {
        const int offset = get<1>(tCcD(make_coord(make_coord(c, 0, st), 0, ni))) - col0;  // a constant
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) {
          const float v = acc(make_coord(make_coord(c, i % 2, st), i / 2, ni));
          z[i] = offset == t_off[i] ? v : z[i];
        }
      }
    }
  }
  return true;
}

// Check, initialize and queue one of our GemmUniversalAdapter instantiations: nullptr, or why not (refused:
// the message when CUTLASS cannot implement the problem, naming what the caller's layout rules are).
template <class Device>
const char* launch(typename Device::Arguments const& args, void* workspace, cudaStream_t stream, const char* refused) {
  Device gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return refused;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS failed to initialize the fused GEMM";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    return "CUTLASS failed to launch the fused GEMM";
  }
  return nullptr;
}

// The mainloop every fused GEMM runs (x [rows, depth] and W [cols, depth], both K-major, float32
// accumulators), with its stages carved out around the epilogue's shared memory.
template <class Element, Schedule S, int kEpilogueSmemBytes>
using FusedMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 16 / sizeof(Element),
    Element, cutlass::layout::ColumnMajor, 16 / sizeof(Element), float, typename ScheduleConfig<S>::Tile,
    typename ScheduleConfig<S>::Cluster, cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>,
    typename ScheduleConfig<S>::Kernel>::CollectiveOp;

template <class Element, Schedule S, class EpilogueOp>
struct FusedGemm {
  using Config = ScheduleConfig<S>;
  static constexpr int kTileCols = cute::size<1>(typename Config::Tile{});
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp>;
  using Mainloop = FusedMainloop<Element, S, static_cast<int>(sizeof(typename Epilogue::SharedStorage))>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Device::Arguments arguments(const void* x, int64_t x_stride, const void* weight,
                                              int64_t weight_stride, int64_t rows, int64_t cols, int64_t depth,
                                              typename EpilogueOp::Arguments const& epi, int sm_count) {
    typename Kernel::StrideA stride_a{x_stride, cute::Int<1>{}, x_stride * rows};
    typename Kernel::StrideB stride_b{weight_stride, cute::Int<1>{}, weight_stride * cols};
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = sm_count;
    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(depth), 1},
        {static_cast<const Element*>(x), stride_a, static_cast<const Element*>(weight), stride_b},
        epi,
        hw};
    return args;
  }

  static const char* run(typename Device::Arguments const& args, void* workspace, cudaStream_t stream) {
    return launch<Device>(args, workspace, stream,
                          "CUTLASS cannot implement this fused GEMM (alignment of x / weight / strides?)");
  }
};

}  // namespace gemm
}  // namespace hugehead

// One explicit instantiation per generated .cu (instances.def): the launchers NAME_workspace / NAME_run that
// dispatch.cu calls, for a GEMM struct (the variadic argument: its template arguments have commas) with static
// workspace_bytes(PARAMS) and run(PARAMS, workspace, stream).
#define HUGEHEAD_FUSED_GEMM_INSTANCE(NAME, PARAMS, ...)                                                       \
  namespace hugehead {                                                                                     \
  namespace gemm {                                                                                         \
  size_t NAME##_workspace(const PARAMS& p) { return __VA_ARGS__::workspace_bytes(p); }                      \
  const char* NAME##_run(const PARAMS& p, void* workspace, cudaStream_t stream) {                          \
    return __VA_ARGS__::run(p, workspace, stream);                                                         \
  }                                                                                                        \
  }                                                                                                        \
  }
