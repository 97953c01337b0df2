// A fused GEMM whose [rows, cols] output (x's dtype) goes through CUTLASS's sm90 TMA warp-specialized collective
// epilogue from the builder, with fusion callbacks of ours: subtiles staged in shared memory by stmatrix and
// written by TMA stores that run while the warpgroup goes on. Shared by grad_tma_gemm.cuh (dLoss/dlogits) and
// stats_store_gemm.cuh (the logits, after the statistics fold). Wrap<Collective> may derive from the collective
// to work on each tile's accumulators before it stores them (default: the collective as it is). EpiTile: the
// subtiles staged and stored in turn (default CUTLASS's choice: 64 x 32 for 16-bit outputs of a pingpong kernel).
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>

#include <cstdint>
#include <type_traits>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

template <class Collective>
using PlainCollective = Collective;

// The wide epilogue subtile of the gradient's 128 x 192 tiles, in place of CUTLASS's 64 x 32: 64 x 64, so a 128 x 192 tile stages and stores 6 subtiles instead of 12 -- half the fences, named barriers and TMA
// store issues a tile (SASS of the gradient's fast path at sm_90a: 1640 instructions against 1744), in 2 x 8 KB of
// shared memory, which leaves the mainloop its 5 stages of 40 KB.
using WideEpiTile = cute::Shape<cute::_64, cute::_64>;

// What every fusion callbacks of ours (the root of the TMA collective epilogue's visitor tree) gives CUTLASS alike:
// its params are its arguments, it needs no workspace, and it loads neither C nor anything through the producer
// warp. A callbacks type derives from this with its Arguments and adds can_implement, its constructors and its
// consumer store callbacks.
template <class Arguments_>
struct TmaCallbacksBase {
  struct SharedStorage {};
  using Arguments = Arguments_;
  using Params = Arguments_;

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

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }
};

template <class Element, Schedule S, class Callbacks, template <class> class Wrap = PlainCollective,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto>
struct TmaStoreGemm {
  using Config = ScheduleConfig<S>;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kTileCols = cute::size<1>(typename Config::Tile{});
  // The cooperative kernel's two warpgroups share a tile, and so its epilogue.
  using EpilogueSchedule = std::conditional_t<S == Schedule::kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  using Collective = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      EpiTile, float, float, void, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::RowMajor, kAlign, EpilogueSchedule, Callbacks>::CollectiveOp;
  using Epilogue = Wrap<Collective>;
  using Mainloop = FusedMainloop<Element, S, static_cast<int>(sizeof(typename Epilogue::SharedStorage))>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // out: [rows, cols] with row stride out_stride (16-byte aligned base and rows: TMA's rules).
  static typename Device::Arguments arguments(const void* x, int64_t x_stride, const void* weight,
                                              int64_t weight_stride, int64_t rows, int64_t cols, int64_t depth,
                                              typename Callbacks::Arguments const& cb, void* out, int64_t out_stride,
                                              int sm_count) {
    typename Kernel::StrideA stride_a{x_stride, cute::Int<1>{}, x_stride * rows};
    typename Kernel::StrideB stride_b{weight_stride, cute::Int<1>{}, weight_stride * cols};
    typename Kernel::StrideD stride_d{out_stride, cute::Int<1>{}, out_stride * rows};
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = sm_count;
    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(rows), static_cast<int>(cols), static_cast<int>(depth), 1},
        {static_cast<const Element*>(x), stride_a, static_cast<const Element*>(weight), stride_b},
        {cb, nullptr, stride_d, static_cast<Element*>(out), stride_d},
        hw};
    return args;
  }
};

}  // namespace gemm
}  // namespace hugehead
