// The statistics GEMM that also stores its logits: for the chunks whose logits are kept (the kept chunks of
// the forward, the rows plan's row blocks), where cuBLAS's GEMM wrote z and chunk_stats_ then read all of it
// again (xc1M's rows plan: 16.4 GB a step, 4.1 ms at 4 TB/s). Each tile's accumulators go first through the
// statistics epilogue's fold (stats_gemm.cuh, the same code and so the same bits as the GEMM that stores
// nothing), which turns them into z = acc + bias rounded to Element in place, then through CUTLASS's sm90 TMA
// warp-specialized collective epilogue (subtiles staged in shared memory, written by TMA stores while the
// warpgroup goes on, as grad_tma_gemm.cuh stores the gradient), which stores z as it is: the stored logits are
// exactly the values the statistics were folded from. On the 128 x 192 tile fold_pairs() packs the logits two to
// a register and writes each pair back into the accumulators as it reads it for the last time (kInPlace), so
// the raw accumulators and the pairs are never all live at once (ptxas, sm_90a: 458 bytes a thread spilled in
// bf16, nearly all on the tiles past the problem's columns, against ~3.5 KB writing them back after the fold).
//
// No softcap: kept logits are stored raw (chunk_stats_ / chunk_grad_ apply the cap to what they read), and
// the fold leaves the capped values in the accumulators. The host entry (gemm_chunk_stats.cu) refuses it.
#pragma once

#include <cstdint>

#include "stats_gemm.cuh"
#include "tma_store_gemm.cuh"

namespace hugehead {
namespace gemm {

// The fusion callbacks of the store: each accumulator element as it is (already z). Their params are the
// statistics epilogue's, which StatsStoreEpilogue below reads from the collective's params.
template <class Element>
struct StoreLogitsCallbacks : TmaCallbacksBase<typename StatsEpilogue<Element>::Arguments> {
  using Base = TmaCallbacksBase<typename StatsEpilogue<Element>::Arguments>;
  using typename Base::Arguments;
  using typename Base::Params;
  using typename Base::SharedStorage;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return StatsEpilogue<Element>::can_implement(shape, args);
  }

  CUTLASS_HOST_DEVICE StoreLogitsCallbacks() {}
  CUTLASS_HOST_DEVICE StoreLogitsCallbacks(Params const&, SharedStorage const&) {}

  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const& acc,
                                                             int, int, int) {
      // z is already representable in Element: the collective's conversion to Element is exact.
      return acc;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const&) {
    return ConsumerStoreCallbacks{};
  }
};

// CUTLASS's TMA collective epilogue (Base) with the statistics fold run on each tile's accumulators first (which
// leaves them holding z).
template <class Base>
struct StatsStoreEpilogue : Base {
  using Element = typename Base::ElementD;

  CUTLASS_HOST_DEVICE StatsStoreEpilogue(typename Base::Params const& p, typename Base::TensorStorage& shared)
      : Base(p, shared), stats(p.thread) {}

  template <class LoadPipeline, class LoadState, class StorePipeline, class StoreState, class ProblemShapeMNKL,
            class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout, class TiledMma, class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadState load_state, StorePipeline store_pipeline,
                            StoreState store_state, ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, typename Base::TensorStorage& shared, Rest... rest) {
    stats.template fold_tile<true>(problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma,
                                   thread_idx);
    return Base::store(load_pipeline, load_state, store_pipeline, store_state, problem_shape_mnkl, tile_shape_MNK,
                       tile_coord_mnkl, accumulators, tiled_mma, thread_idx, shared, rest...);
  }

  StatsEpilogue<Element> stats;
};

template <class Element, Schedule S>
struct StatsStoreGemm {
  using Gemm = TmaStoreGemm<Element, S, StoreLogitsCallbacks<Element>, StatsStoreEpilogue>;
  using Device = typename Gemm::Device;

  static typename Device::Arguments arguments(const StatsGemmParams& p) {
    auto epi = stats_epilogue_arguments<Element>(p, Gemm::kTileCols);
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth, epi, p.logits,
                           p.logits_stride, p.sm_count);
  }
  static size_t workspace_bytes(const StatsGemmParams& p) { return Device::get_workspace_size(arguments(p)); }
  static const char* run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {
    return launch<Device>(arguments(p), workspace, stream,
                          "CUTLASS cannot implement this statistics GEMM with stored logits (alignment of logits?)");
  }
};

}  // namespace gemm
}  // namespace hugehead
