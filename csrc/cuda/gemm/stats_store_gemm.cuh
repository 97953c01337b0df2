// The statistics GEMM that also stores its logits: the rows plan (hugehead/loop.py rows_steps) keeps a block
// of rows' logits over every class and turns them into their gradient in place, so it needs z stored, and
// cuBLAS's GEMM + chunk_stats_ read z back once more to fold it (H200, xc1M: 4.6 ms a step). Here the
// statistics epilogue of stats_gemm.cuh folds each tile from the accumulators, which it leaves holding z (the
// logits rounded to Element, bias added: what cuBLAS's addmm stores), and CUTLASS's sm90 TMA warp-specialized
// collective epilogue then stores them through shared memory (as grad_tma_gemm.cuh stores a gradient).
// No softcap: the rows plan stores the logits before the softcap, the statistics epilogue caps in place.
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>

#include <cstdint>
#include <type_traits>

#include "stats_gemm.cuh"

namespace hugehead {
namespace gemm {

template <class Element, Schedule S>
struct StatsStoreGemm {
  using Config = ScheduleConfig<S>;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kTileCols = cute::size<1>(typename Config::Tile{});
  using Stats = StatsEpilogue<Element>;
  using EpilogueSchedule = std::conditional_t<S == Schedule::kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  // Stores the accumulators as they are (Sm90AccFetch: D = acc, converted to Element).
  using Store = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::RowMajor, kAlign, EpilogueSchedule, cutlass::epilogue::fusion::Sm90AccFetch>::CollectiveOp;

  // The collective epilogue with the statistics fold run on the accumulators first; everything else (its
  // pipelines, shared memory, TMA descriptor) is Store's.
  struct Epilogue : Store {
    struct Arguments : Store::Arguments {
      typename Stats::Arguments stats;
    };
    struct Params : Store::Params {
      typename Stats::Params stats;
    };

    template <class ProblemShape>
    static constexpr Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
      Params p;
      static_cast<typename Store::Params&>(p) = Store::to_underlying_arguments(shape, args, workspace);
      p.stats = Stats::to_underlying_arguments(shape, args.stats, nullptr);
      return p;
    }
    template <class ProblemShape>
    static bool can_implement(ProblemShape const& shape, Arguments const& args) {
      return Store::can_implement(shape, args) && Stats::can_implement(shape, args.stats) && !(args.stats.softcap > 0.f);
    }
    CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& p) { Store::prefetch_tma_descriptors(p); }

    CUTLASS_HOST_DEVICE Epilogue(Params const& p, typename Store::TensorStorage& shared_tensors)
        : Store(p, shared_tensors), stats(p.stats) {}

    template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
              class TiledMma>
    CUTLASS_DEVICE auto store(typename Store::LoadPipeline load_pipeline,
                              typename Store::LoadPipelineState load_pipe_consumer_state,
                              typename Store::StorePipeline store_pipeline,
                              typename Store::StorePipelineState store_pipe_producer_state,
                              ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                              TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                              TiledMma tiled_mma, int thread_idx, typename Store::TensorStorage& shared_tensors,
                              int subtile_idx = -1) {
      // Leaves z in the accumulators (rounded, bias added; no softcap: can_implement).
      stats(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, cute::make_tuple(0, 0, 0),
            thread_idx, nullptr);
      return Store::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                          problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                          shared_tensors, subtile_idx);
    }

    Stats stats;
  };

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Store::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Device::Arguments arguments(const StatsGemmParams& p) {
    typename Epilogue::Arguments epi;
    typename Kernel::StrideD stride_d{p.logits_stride, cute::Int<1>{}, p.logits_stride * p.rows};
    epi.ptr_C = nullptr;
    epi.dC = stride_d;
    epi.ptr_D = static_cast<Element*>(p.logits);
    epi.dD = stride_d;
    epi.stats = StatsGemm<Element, S>::epilogue_arguments(p);
    typename Kernel::StrideA stride_a{p.x_stride, cute::Int<1>{}, p.x_stride * p.rows};
    typename Kernel::StrideB stride_b{p.weight_stride, cute::Int<1>{}, p.weight_stride * p.cols};
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
    const auto args = arguments(p);
    Device gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return "CUTLASS cannot implement this statistics GEMM with stored logits (alignment of logits? a softcap?)";
    }
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
      return "CUTLASS failed to initialize the statistics GEMM with stored logits";
    }
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      return "CUTLASS failed to launch the statistics GEMM with stored logits";
    }
    return nullptr;
  }
};

}  // namespace gemm
}  // namespace hugehead

#define HUGEHEAD_STATS_STORE_GEMM_INSTANCE(NAME, ELEMENT, SCHEDULE)                                              \
  namespace hugehead {                                                                                        \
  namespace gemm {                                                                                            \
  size_t NAME##_workspace(const StatsGemmParams& p) { return StatsStoreGemm<ELEMENT, SCHEDULE>::workspace_bytes(p); } \
  const char* NAME##_run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {                    \
    return StatsStoreGemm<ELEMENT, SCHEDULE>::run(p, workspace, stream);                                      \
  }                                                                                                           \
  }                                                                                                           \
  }
