// The backward's recompute GEMM with the gradient stored through shared memory and TMA (tma_store_gemm.cuh:
// CUTLASS's sm90 TMA collective epilogue) with a fusion callback of ours that turns each accumulator fragment
// into dLoss/dlogits. grad_gemm.cuh's register epilogue stores each adjacent pair with its own 32-bit STG:
// a warp's store then covers 8 rows x 16 bytes, half of every 32-byte sector it touches, which left that
// GEMM well behind the statistics GEMM that stores nothing.
//
// This path covers the plain loss (no bias, softcap, z-loss or returned lse: g (p - eps / V), the target's
// (1 - eps) apart) into a grad_logits TMA can address (16-byte aligned base and row stride); every other
// call takes grad_gemm.cuh's epilogue. The arithmetic per element is that epilogue's fast path, so both
// write the same bits.
#pragma once

#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "tma_store_gemm.cuh"

namespace hugehead {
namespace gemm {

// The fusion callbacks (the root of the epilogue's visitor tree, a leaf that reads the accumulator): per
// element, z = the accumulator rounded to Element (the logit cuBLAS would store), p = exp(z - lse), and
// g (p - eps / V) - g (1 - eps) [column == target]; rows with g == 0 (ignored, or beyond the problem) are
// exact zeros. The per-row inputs are loaded once per tile into registers that broadcast along the columns
// (as CUTLASS's Sm90ColBroadcast holds a column vector).
struct GradTmaArguments {
  const int64_t* target = nullptr;
  const float* lse = nullptr;
  const float* grad_rows = nullptr;
  int64_t class_start = 0;
  float smooth = 0.f;         // label_smoothing / num_classes
  float target_weight = 1.f;  // 1 - label_smoothing
  // Without label smoothing (GradGemmParams::fold_g): a row with g > 0 takes g p as exp(z - (lse - log g)), its
  // log2(g) folded into the exponent's offset once a tile, so an element is one FFMA and one MUFU.EX2 with no
  // multiply by g. Not the bits of g * p (the offset's float32 rounding moves the exponent by ~1e-7 |lse - log g|);
  // rows with g <= 0 (or NaN) keep g * p.
  bool fold_g = false;
  bool exact = false;  // the accumulator is the logit, not rounded to Element (GradGemmParams::exact)
};

template <class Element>
struct GradTmaCallbacks : TmaCallbacksBase<GradTmaArguments> {
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.target != nullptr && args.lse != nullptr && args.grad_rows != nullptr;
  }

  CUTLASS_HOST_DEVICE GradTmaCallbacks() {}
  CUTLASS_HOST_DEVICE GradTmaCallbacks(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  // RowF / RowI: (CPY, CPY_M, CPY_N, EPI_M, EPI_N) register tensors with stride 0 along N (one value per row
  // of the thread); Coords: the same shape, coordinates relative to the thread's first element (the
  // collective's static coordinate tensor), whose (row, column) in the chunk is (m0, n0).
  template <class RowF, class RowI, class Coords, class Residue, int kTileN>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RowF lse_log2e_, RowF g_, RowI t_, Coords tCcD_, Residue residue_,
                                          Params const& params_, int m0_, int n0_)
        : lse_log2e(lse_log2e_), g(g_), t(t_), tCcD(tCcD_), residue(residue_), params(params_), m0(m0_), n0(n0_) {}

    RowF lse_log2e;  // lse log2(e), for exp_minus (fold_g: less log2(g) where g > 0)
    RowF g;          // dLoss/dloss_row, 0 for rows beyond the problem
    RowI t;          // the target's column relative to the thread's first column, or -1 when it is not here
    Coords tCcD;
    Residue residue;
    Params const& params;
    int m0, n0;  // the thread's first row and column in the chunk
    bool warp_targets = true;  // whether a row of any lane of the warp has its target in this tile
    bool warp_zero_rows = true;  // whether a row of any lane of the warp has g == 0 (ignored, or beyond the problem)

    CUTLASS_DEVICE void begin() {
      using namespace cute;
      // One load per distinct row: the stride-0 (column) modes filtered out.
      Tensor lse_flt = filter_zeros(lse_log2e);
      Tensor g_flt = filter_zeros(g);
      Tensor t_flt = filter_zeros(t);
      Tensor c_flt = filter_zeros(tCcD, lse_log2e.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(lse_flt); ++i) {
        const int r = get<0>(c_flt(i));
        const bool ok = r < get<0>(residue);
        const int row = m0 + r;
        const float gi = ok ? params.grad_rows[row] : 0.f;
        g_flt(i) = gi;
        // log2(g) by the SFU (log2_sfu: log2f's polynomial was ~35 instructions a row, ~20% of the epilogue's
        // per-tile instructions beside its 192 elements a thread).
        lse_flt(i) = ok ? params.lse[row] * kLog2e - (params.fold_g && gi > 0.f ? log2_sfu(gi) : 0.f) : 0.f;
        const int64_t rel = ok ? params.target[row] - params.class_start - n0 : int64_t(-1);
        t_flt(i) = (rel >= 0 && rel < int64_t(1) << 30) ? static_cast<int>(rel) : -1;
      }
      // A tile holds few rows' targets (at most one row in V / tile width), so the per-element compare runs
      // only where a lane of the warp has one here (a uniform branch), not for every element.
      bool here = false, zero = false;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(t_flt); ++i) {
        here |= t_flt(i) >= 0 && t_flt(i) < kTileN;
        zero |= params.fold_g ? !(g_flt(i) > 0.f) : g_flt(i) == 0.f;
      }
      warp_targets = __any_sync(0xffffffffu, here);
      // Likewise the exact zero of a row with g == 0 (whatever its logits): selected per element only in the
      // warps that have such a row; elsewhere g * d is what the select would have kept. With fold_g every row
      // with g <= 0 (whose exponent holds no log2(g)) takes that checked path.
      warp_zero_rows = __any_sync(0xffffffffu, zero);
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(cutlass::Array<ElementAccumulator, FragmentSize> const& acc,
                                                             int epi_v, int epi_m, int epi_n) {
      using namespace cute;
      Tensor lse_mn = lse_log2e(_, _, _, epi_m, epi_n);
      Tensor g_mn = g(_, _, _, epi_m, epi_n);
      Tensor t_mn = t(_, _, _, epi_m, epi_n);
      Tensor c_mn = tCcD(_, _, _, epi_m, epi_n);
      cutlass::Array<float, FragmentSize> out;
      if (params.exact) {  // the accumulator as it is (a uniform branch)
        elements_of(acc, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
      } else {  // rounded as cuBLAS rounds the logits it stores (pairs by one cvt.rn.bf16x2)
        elements_of(cutlass::NumericArrayConverter<Element, ElementAccumulator, FragmentSize>{}(acc), out, lse_mn,
                    g_mn, t_mn, c_mn, epi_v);
      }
      return out;
    }

    // Without label smoothing p - 0 is p (the same bits), so that subtraction is left out; likewise the
    // target's compare where no lane of the warp holds a target (begin()). Uniform branches.
    template <class Z, class Out, class L, class G, class T, class C>
    CUTLASS_DEVICE void elements_of(Z const& z, Out& out, L const& lse_mn, G const& g_mn, T const& t_mn,
                                    C const& c_mn, int epi_v) const {
      if (params.fold_g) {  // (smooth is 0 here: the host's rule)
        if (warp_targets || warp_zero_rows) folded<true>(z, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
        else folded<false>(z, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
      } else if (params.smooth == 0.f) {
        if (warp_targets || warp_zero_rows) elements<false, true>(z, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
        else elements<false, false>(z, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
      } else {
        if (warp_targets || warp_zero_rows) elements<true, true>(z, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
        else elements<true, false>(z, out, lse_mn, g_mn, t_mn, c_mn, epi_v);
      }
    }

    // fold_g's elements: e = exp(z - lse + log g) = g p where g > 0 (the exponent's offset from begin()); kChecked
    // (a warp with a target or a row with g <= 0): the target's g (1 - eps) off, and g * p where g <= 0 (such a
    // row's offset holds no log2(g), so e is p there), exact zeros where g == 0.
    template <bool kChecked, class Z, class Out, class L, class G, class T, class C>
    CUTLASS_DEVICE void folded(Z const& z, Out& out, L const& lse_mn, G const& g_mn, T const& t_mn, C const& c_mn,
                               int epi_v) const {
      using namespace cute;
      constexpr int kSize = Out::kElements;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kSize; ++i) {
        const int idx = epi_v * kSize + i;
        const float e = exp_minus(static_cast<float>(z[i]), lse_mn(idx));
        if constexpr (kChecked) {
          const float gi = g_mn(idx);
          const bool t = get<1>(c_mn(idx)) == t_mn(idx);
          if (gi > 0.f) {
            out[i] = t ? e - gi * params.target_weight : e;
          } else {
            out[i] = gi == 0.f ? 0.f : gi * (t ? e - params.target_weight : e);
          }
        } else {
          out[i] = e;
        }
      }
    }

    // kChecked: the target's compare and the exact zero of rows with g == 0 (both rare in a warp's tile).
    template <bool kSmooth, bool kChecked, class Z, class Out, class L, class G, class T, class C>
    CUTLASS_DEVICE void elements(Z const& z, Out& out, L const& lse_mn, G const& g_mn, T const& t_mn, C const& c_mn,
                                 int epi_v) const {
      using namespace cute;
      constexpr int kSize = Out::kElements;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kSize; ++i) {
        const int idx = epi_v * kSize + i;
        const float p = exp_minus(static_cast<float>(z[i]), lse_mn(idx));
        float d = kSmooth ? p - params.smooth : p;
        const float gi = g_mn(idx);
        if constexpr (kChecked) {
          if (get<1>(c_mn(idx)) == t_mn(idx)) d = d - params.target_weight;
          out[i] = gi == 0.f ? 0.f : gi * d;
        } else {
          out[i] = gi * d;
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    // A column vector (stride 1 along M, 0 along N and L), partitioned like the thread's accumulator
    // subtiles; only its layout is used (the values are loaded in begin()).
    Tensor mRow = make_tensor(make_gmem_ptr(params.lse), make_layout(make_shape(M, N, L), make_stride(_1{}, _0{}, _0{})));
    Tensor tCgRow = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        mRow, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor lse_r = make_tensor_like<float>(tCgRow);
    Tensor g_r = make_tensor_like<float>(tCgRow);
    Tensor t_r = make_tensor_like<int>(tCgRow);
    // args.residue_tCcD is (M, N) minus the thread's first coordinate.
    const int m0 = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    constexpr int kTileN = decltype(size<1>(args.tile_shape_mnk))::value;
    return ConsumerStoreCallbacks<decltype(lse_r), decltype(t_r), decltype(args.tCcD), decltype(args.residue_tCcD), kTileN>(
        lse_r, g_r, t_r, args.tCcD, args.residue_tCcD, params, m0, n0);
  }
};

template <class Element, Schedule S, class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto>
struct GradTmaGemm {
  using Gemm = TmaStoreGemm<Element, S, GradTmaCallbacks<Element>, PlainCollective, EpiTile>;
  using Device = typename Gemm::Device;

  static typename Device::Arguments arguments(const GradGemmParams& p) {
    typename GradTmaCallbacks<Element>::Arguments cb;
    cb.target = p.target;
    cb.lse = p.lse;
    cb.grad_rows = p.grad_rows;
    cb.class_start = p.class_start;
    // As grad_gemm.cuh computes them, so both paths write the same bits.
    cb.smooth = static_cast<float>(static_cast<double>(p.label_smoothing) / static_cast<double>(p.num_classes));
    cb.target_weight = 1.f - p.label_smoothing;
    cb.fold_g = cb.smooth == 0.f;
    cb.exact = p.exact;
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth, cb, p.grad_logits,
                           p.grad_stride, p.sm_count);
  }
  static size_t workspace_bytes(const GradGemmParams& p) { return Device::get_workspace_size(arguments(p)); }
  static const char* run(const GradGemmParams& p, void* workspace, cudaStream_t stream) {
    return launch<Device>(arguments(p), workspace, stream,
                          "CUTLASS cannot implement this fused gradient GEMM (TMA store: alignment of grad_logits?)");
  }
};

}  // namespace gemm
}  // namespace hugehead
