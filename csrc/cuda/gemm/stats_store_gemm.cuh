// The statistics GEMM that also stores its logits: the rows plan (hugehead/loop.py rows_steps) keeps a block
// of rows' logits over every class and turns them into their gradient in place, so it needs z stored, and
// cuBLAS's GEMM + chunk_stats_ read z back once more to fold it (H200, xc1M: 4.6 ms a step).
//
// CUTLASS's sm90 TMA warp-specialized collective epilogue stores z (subtiles staged in shared memory,
// written by TMA stores, as grad_tma_gemm.cuh stores a gradient), and its fusion callbacks fold each
// fragment into the thread's running per-row statistics on the way. A first version ran stats_gemm.cuh's
// register fold over the whole tile before the collective's store: the two then ran one after the other and
// the epilogue outlasted the other warpgroup's MMAs (H200 at 0fb5887, the rows plan's 4 logits GEMMs at
// xc1M: 25.48 ms against cuBLAS's 19.48 + chunk_stats_'s 4.64).
//
// The fold is online, one exponential per element: with d = z - m, e = exp(-|d|) is exp(z - m) when z <= m
// (s += e) and exp(m - z) when z > m (s = s e + 1, m = z). At the tile's end the quad holding each row merges
// its four lanes' (m, s) as stats_gemm.cuh does, and writes the row's partial (max, sum of exp, sum of z);
// the host's merge kernel folds the partials. No softcap (the rows plan stores the uncapped logits).
#pragma once

#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

template <class Element>
struct StatsStoreCallbacks {
  struct SharedStorage {};
  struct Arguments {
    const int64_t* target = nullptr;  // [rows] global class ids
    float* target_logit = nullptr;    // [rows]: set for the rows whose target is in the chunk
    float* partials = nullptr;        // [rows, num_col_tiles, 4]
    int64_t class_start = 0;
    int64_t num_col_tiles = 0;
    bool logit_sum = true;
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
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE StatsStoreCallbacks() {}
  CUTLASS_HOST_DEVICE StatsStoreCallbacks(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  // RowF / RowI: (CPY, CPY_M, CPY_N, EPI_M, EPI_N) register tensors with stride 0 along N (one value per row
  // of the thread); Coords: coordinates relative to the thread's first element, whose (row, column) in the
  // chunk is (m0, n0) (grad_tma_gemm.cuh says why).
  template <class RowF, class RowI, class Coords, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RowF m_, RowF s_, RowF sum_, RowF tz_, RowI t_, Coords tCcD_,
                                          Residue residue_, Params const& params_, int m0_, int n0_, int n_tile_,
                                          bool full_)
        : m(m_), s(s_), sum(sum_), tz(tz_), t(t_), tCcD(tCcD_), residue(residue_), params(params_), m0(m0_),
          n0(n0_), n_tile(n_tile_), full(full_) {}

    RowF m, s, sum, tz;  // running max, sum of exp(z - max), sum of z, target logit
    RowI t;              // the target's column relative to the thread's first column; -1: not here; -2: found
    Coords tCcD;
    Residue residue;
    Params const& params;
    int m0, n0, n_tile;
    bool full;  // the tile lies inside the problem: no element needs a bounds check

    CUTLASS_DEVICE void begin() {
      using namespace cute;
      Tensor m_flt = filter_zeros(m);
      Tensor s_flt = filter_zeros(s);
      Tensor sum_flt = filter_zeros(sum);
      Tensor tz_flt = filter_zeros(tz);
      Tensor t_flt = filter_zeros(t);
      Tensor c_flt = filter_zeros(tCcD, m.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(m_flt); ++i) {
        const int r = get<0>(c_flt(i));
        const bool ok = r < get<0>(residue);
        m_flt(i) = -INFINITY;
        s_flt(i) = 0.f;
        sum_flt(i) = 0.f;
        tz_flt(i) = 0.f;
        const int64_t rel = ok ? params.target[m0 + r] - params.class_start - n0 : int64_t(-1);
        t_flt(i) = (rel >= 0 && rel < int64_t(1) << 30) ? static_cast<int>(rel) : -1;
      }
    }

    template <bool kFull, int FragmentSize>
    CUTLASS_DEVICE void fold(cutlass::Array<float, FragmentSize> const& z, int epi_v, int epi_m, int epi_n) {
      using namespace cute;
      Tensor m_mn = m(_, _, _, epi_m, epi_n);
      Tensor s_mn = s(_, _, _, epi_m, epi_n);
      Tensor sum_mn = sum(_, _, _, epi_m, epi_n);
      Tensor tz_mn = tz(_, _, _, epi_m, epi_n);
      Tensor t_mn = t(_, _, _, epi_m, epi_n);
      Tensor c_mn = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        const int idx = epi_v * FragmentSize + i;
        const auto c = c_mn(idx);
        if constexpr (!kFull) {
          if (!(get<0>(c) < get<0>(residue) && get<1>(c) < get<1>(residue))) continue;
        }
        const float zi = z[i];
        const float mi = m_mn(idx);
        const float d = zi - mi;
        const float e = exp2_ftz(-::fabsf(d) * kLog2e);
        s_mn(idx) = d > 0.f ? ::fmaf(s_mn(idx), e, 1.f) : s_mn(idx) + e;
        m_mn(idx) = ::fmaxf(mi, zi);
        if (params.logit_sum) sum_mn(idx) += zi;
        if (get<1>(c) == t_mn(idx)) {  // this thread's element at the target: kept, and marked found (-2)
          tz_mn(idx) = zi;
          t_mn(idx) = -2;
        }
      }
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const& acc,
                                                             int epi_v, int epi_m, int epi_n) {
      // z rounded as cuBLAS rounds the logits it stores: the values stored and the values folded.
      const cutlass::Array<Element, FragmentSize> zr =
          cutlass::NumericArrayConverter<Element, ElementAccumulator, FragmentSize>{}(acc);
      const cutlass::Array<float, FragmentSize> z = cutlass::NumericArrayConverter<float, Element, FragmentSize>{}(zr);
      if (full) fold<true>(z, epi_v, epi_m, epi_n);
      else fold<false>(z, epi_v, epi_m, epi_n);
      return z;
    }

    CUTLASS_DEVICE void end() {
      using namespace cute;
      Tensor m_flt = filter_zeros(m);
      Tensor s_flt = filter_zeros(s);
      Tensor sum_flt = filter_zeros(sum);
      Tensor tz_flt = filter_zeros(tz);
      Tensor t_flt = filter_zeros(t);
      Tensor c_flt = filter_zeros(tCcD, m.stride());
      const int lane = static_cast<int>(threadIdx.x) % 32;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(m_flt); ++i) {
        // The quad holding the row: xor shuffles give its four lanes the same (commutative) merge.
        float mi = m_flt(i), si = s_flt(i), sumi = sum_flt(i);
        CUTLASS_PRAGMA_UNROLL
        for (int off = 1; off < 4; off *= 2) {
          const float m2 = __shfl_xor_sync(0xffffffffu, mi, off);
          const float s2 = __shfl_xor_sync(0xffffffffu, si, off);
          sumi += __shfl_xor_sync(0xffffffffu, sumi, off);
          const float mm = ::fmaxf(mi, m2);
          si = (mi == -INFINITY ? 0.f * si : si * __expf(mi - mm)) + (m2 == -INFINITY ? 0.f * s2 : s2 * __expf(m2 - mm));
          mi = mm;
        }
        const int r = get<0>(c_flt(i));
        if (!(r < get<0>(residue))) continue;
        const int64_t row = m0 + r;
        if (t_flt(i) == -2) params.target_logit[row] = tz_flt(i);  // the lane that folded the target's column
        if (lane % 4 == 0) {
          reinterpret_cast<float4*>(params.partials)[row * params.num_col_tiles + n_tile] =
              make_float4(mi, si, params.logit_sum ? sumi : 0.f, 0.f);
        }
      }
    }

  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    Tensor mRow = make_tensor(make_gmem_ptr(params.partials),
                              make_layout(make_shape(M, N, L), make_stride(_1{}, _0{}, _0{})));
    Tensor tCgRow = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        mRow, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor m_r = make_tensor_like<float>(tCgRow);
    Tensor s_r = make_tensor_like<float>(tCgRow);
    Tensor sum_r = make_tensor_like<float>(tCgRow);
    Tensor tz_r = make_tensor_like<float>(tCgRow);
    Tensor t_r = make_tensor_like<int>(tCgRow);
    const int m0 = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    const int tile_m = static_cast<int>(get<0>(args.tile_coord_mnkl));
    const int tile_n = static_cast<int>(get<1>(args.tile_coord_mnkl));
    constexpr int kTileM = size<0>(decltype(args.tile_shape_mnk){});
    constexpr int kTileN = size<1>(decltype(args.tile_shape_mnk){});
    const bool full = (tile_m + 1) * kTileM <= static_cast<int>(M) && (tile_n + 1) * kTileN <= static_cast<int>(N);
    return ConsumerStoreCallbacks<decltype(m_r), decltype(t_r), decltype(args.tCcD), decltype(args.residue_tCcD)>(
        m_r, s_r, sum_r, tz_r, t_r, args.tCcD, args.residue_tCcD, params, m0, n0, tile_n, full);
  }
};

template <class Element, Schedule S>
struct StatsStoreGemm {
  using Config = ScheduleConfig<S>;
  static_assert(S == Schedule::kPingpong, "the partials' tile width is the pingpong schedule's 128 columns");
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kTileCols = cute::size<1>(typename Config::Tile{});
  using Callbacks = StatsStoreCallbacks<Element>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile, typename Config::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::RowMajor, kAlign, cutlass::epilogue::TmaWarpSpecialized, Callbacks>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Device::Arguments arguments(const StatsGemmParams& p) {
    typename Callbacks::Arguments cb;
    cb.target = p.target;
    cb.target_logit = p.target_logit;
    cb.partials = p.partials;
    cb.class_start = p.class_start;
    cb.num_col_tiles = (p.cols + kTileCols - 1) / kTileCols;
    cb.logit_sum = p.logit_sum;
    typename Kernel::StrideA stride_a{p.x_stride, cute::Int<1>{}, p.x_stride * p.rows};
    typename Kernel::StrideB stride_b{p.weight_stride, cute::Int<1>{}, p.weight_stride * p.cols};
    typename Kernel::StrideD stride_d{p.logits_stride, cute::Int<1>{}, p.logits_stride * p.rows};
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = p.sm_count;
    return typename Device::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {static_cast<int>(p.rows), static_cast<int>(p.cols), static_cast<int>(p.depth), 1},
        {static_cast<const Element*>(p.x), stride_a, static_cast<const Element*>(p.weight), stride_b},
        {cb, nullptr, stride_d, static_cast<Element*>(p.logits), stride_d},
        hw};
  }
  static size_t workspace_bytes(const StatsGemmParams& p) { return Device::get_workspace_size(arguments(p)); }
  static const char* run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {
    const auto args = arguments(p);
    Device gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return "CUTLASS cannot implement this statistics GEMM with stored logits (alignment of the logits?)";
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
