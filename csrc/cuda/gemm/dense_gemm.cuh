// The backward's two dense GEMMs on the chunk's dLoss/dlogits g [rows, cols] (gemm.h's DenseGemmParams):
//   dX: out [rows, depth] float32 (+)= g @ W_c   (A = g, K-major; B = W_c [cols, depth], N-major; K = cols)
//   dW: out [cols, depth]         (+)= g^T @ x   (A = g^T, M-major; B = x [rows, depth], N-major; K = rows)
// on CUTLASS's sm_90a warp-specialized cooperative (or pingpong) kernel (TMA loads, persistent tile scheduler) with its
// collective epilogue (a linear combination, C read by TMA only where beta != 0). No epilogue of ours: what
// these replace is cuBLAS's mm / addmm, with the same per-chunk arithmetic (a float32 sum over K rounded once
// to out's dtype), so the loop's results stay those of one GEMM per chunk.
//
// Why not cuBLAS: dX has few output tiles and a long K (xc6M: 4096 x 768 out of K = 65536, 96 tiles of
// 128 x 256 for 132 SMs), and dX in float32 with beta = 1 (addmm out_dtype) is what the loop wants; here a
// 128 x 192 tile gives 128 tiles, one wave, and C = D = grad_x in place. dW (K = rows) is an ordinary large GEMM.
// Measured (one H200, 0f740e1): they tie cuBLAS, so the loop takes them only when asked
// (HUGEHEAD_GEMM_DENSE=cutlass, ops.dense_gemm_enabled). Under a two-second soak at the ~690 W power cap every
// GEMM of the step, ours or cuBLAS's, runs at 643-663 TFLOP/s (bench/results/h200/gemm_clocks_dense_0f740e1.md).
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

// Tiles, clusters and schedules of a dense GEMM (gemm.h's DenseConfig picks one). Cooperative unless said.
struct Cooperative {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Scheduler = void;  // CUTLASS's persistent data-parallel tile scheduler
};
template <DenseKind K, DenseConfig C>
struct DenseTiles;
// dX: 128 x 192 tiles (768 / 192 = 4 column tiles: 128 tiles at 4096 rows), W tiles multicast to the two
// CTAs of a cluster along M.
template <>
struct DenseTiles<DenseKind::kDx, DenseConfig::kDefault> : Cooperative {
  using Tile = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
template <>
struct DenseTiles<DenseKind::kDx, DenseConfig::kAlternate> : Cooperative {
  using Tile = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
};
// dW: 128 x 256 tiles, x tiles multicast along M.
template <>
struct DenseTiles<DenseKind::kDw, DenseConfig::kDefault> : Cooperative {
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
template <>
struct DenseTiles<DenseKind::kDw, DenseConfig::kAlternate> : Cooperative {
  using Tile = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
// Pingpong, both kinds: 128 x 192 tiles a warpgroup (the fused GEMMs' pingpong_cluster_192, whose bare mainloop
// soaked at 688 TFLOP/s on an xc6M chunk against 660-675 for every dense GEMM of the step), 2-CTA clusters along
// M; one warpgroup's epilogue (dW's store, dX's float32 read-add-write) under the other's MMAs.
template <DenseKind K>
struct DenseTiles<K, DenseConfig::kPingpong> {
  using Kernel = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  using Scheduler = void;
  using Tile = cute::Shape<cute::_128, cute::_192, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
// Stream-K, both kinds: cooperative 128 x 256 tiles (the widest mainloop, 686-691 TFLOP/s in the soaks) under
// CUTLASS's stream-K scheduler, which splits the K loop of the last, partial wave of output tiles over the SMs
// that would idle (its heuristic: data-parallel waves, then stream-K units; split-K where that is better). The
// persistent scheduler leaves a ragged wave: dX at xc6M is 96 (128 x 256) or 128 (128 x 192) tiles for 132 SMs,
// dX / dW at N = 16384 are 384 tiles (2.9 waves), dW at xc6M 1536 (11.6 waves). The partial accumulators are
// summed in a fixed order (ReductionMode::Deterministic, the default): repeated runs give the same bits; the
// sum's association differs from one accumulator's, so not cuBLAS's bits. Measured (one H200, dbd5ce0, 2.5 s
// soaks, bench/results/h200/s15/c2_dbd5ce0/): slower than cuBLAS everywhere: dX 569 TFLOP/s against 657 at xc6M
// (96 tiles: the split K's fix-ups, the SMs waiting at 1650 MHz), 636 against 650 at xc6M_16k; dW 631 against
// 647 and 654 against 666; whole steps xc6M 244.9 ms against 231.2, xc6M_16k 949.1 against 934.2. An A/B only.
template <DenseKind K>
struct DenseTiles<K, DenseConfig::kStreamK> : Cooperative {
  using Scheduler = cutlass::gemm::StreamKScheduler;
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
};

// ElementC void: no source (out = acc, beta ignored); else C = D = out read where beta != 0.
template <class Element, DenseKind K, DenseConfig Cfg, class ElementC, class ElementD>
struct DenseGemm {
  using Tiles = DenseTiles<K, Cfg>;
  using LayoutA = std::conditional_t<K == DenseKind::kDx, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor>;
  using LayoutB = cutlass::layout::RowMajor;  // [K, N] with N contiguous: weight [cols, depth] or x [rows, depth]
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Tiles::Tile, typename Tiles::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD, kAlignD, ElementD, LayoutD,
      kAlignD, typename Tiles::Epilogue>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign, float,
      typename Tiles::Tile, typename Tiles::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Tiles::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      typename Tiles::Scheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Device::Arguments arguments(const DenseGemmParams& p) {
    using namespace cute;
    // (M, N, K): dX (rows, depth, cols), dW (cols, depth, rows)
    const int64_t m = K == DenseKind::kDx ? p.rows : p.cols;
    const int64_t k = K == DenseKind::kDx ? p.cols : p.rows;
    typename Kernel::StrideA stride_a;
    if constexpr (K == DenseKind::kDx) {
      stride_a = make_stride(p.g_stride, Int<1>{}, p.g_stride * p.rows);  // g[m, k]
    } else {
      stride_a = make_stride(Int<1>{}, p.g_stride, p.g_stride * p.rows);  // g^T[m, k] = g[k, m]
    }
    const typename Kernel::StrideB stride_b = make_stride(Int<1>{}, p.b_stride, p.b_stride * k);
    const typename Epilogue::StrideD stride_d = make_stride(p.out_stride, Int<1>{}, p.out_stride * m);
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = p.sm_count;
    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(m), static_cast<int>(p.depth), static_cast<int>(k), 1},
        {static_cast<const Element*>(p.g), stride_a, static_cast<const Element*>(p.b), stride_b},
        {{},
         std::is_void_v<ElementC> ? nullptr : static_cast<const ElementD*>(p.out),
         stride_d,
         static_cast<ElementD*>(p.out),
         stride_d},
        hw};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.beta = p.accumulate ? 1.f : 0.f;
    return args;
  }

  static size_t workspace_bytes(const DenseGemmParams& p) { return Device::get_workspace_size(arguments(p)); }

  static const char* run(const DenseGemmParams& p, void* workspace, cudaStream_t stream) {
    return launch<Device>(arguments(p), workspace, stream,
                          "CUTLASS cannot implement this dense GEMM (alignment of g / the operand / out / strides?)");
  }
};

}  // namespace gemm
}  // namespace hugehead

// NAME: dense_gemm_<dtype>_<kind>_<out>[_alt]; the variadic argument is the DenseGemm type.
#define HUGEHEAD_DENSE_GEMM_INSTANCE(NAME, ...) \
  HUGEHEAD_FUSED_GEMM_INSTANCE(NAME, DenseGemmParams, hugehead::gemm::DenseGemm<__VA_ARGS__>)
