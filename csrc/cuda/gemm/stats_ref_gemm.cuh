// The statistics GEMM of a kept chunk against a reference: the chunk's logits go out through CUTLASS's sm90 TMA
// collective epilogue as the gradient GEMM's do (grad_tma_gemm.cuh), and the fusion callbacks fold each element
// on its way there into sum exp(z - ref) per (row, column tile), where ref is the row's running max from the
// chunks folded before (row_max as the call finds it). No max is taken over the tile: each partial is (ref,
// sum), which lse_merge folds into (row_max, row_sumexp) as any partial, leaving row_max at ref. The epilogue is
// then one exponential and one add an element beside the store, where stats_store_gemm.cuh runs the whole fold
// (max, then the exponentials) before its TMA store, which left it well behind the gradient GEMM's TMA store.
//
// A reference only works where no logit of the row is far above it: a partial whose sum passes kFlagSum (an
// exponent of ~55, or +inf, e.g. for a row with no finite max yet; fused_gemm.cuh) flags the row, and
// gemm_chunk_stats.cu's merge kernel folds that tile (with probs, the row's whole chunk) again exactly instead of
// its partial (slow, and rare: the row's chunk max would have to lie ~55 above its max over every chunk folded
// before). The loop folds the chunks it does not keep first, so a kept chunk meets a row max over most classes.
//
// z = the accumulator rounded once to Element (no bias, no softcap: the host takes stats_store_gemm.cuh for those,
// and for logit sums), stored as it is; the target's z goes to target_logit as the fold writes it.
#pragma once

#include <cutlass/numeric_conversion.h>

#include <cstdint>

#include "tma_store_gemm.cuh"

namespace hugehead {
namespace gemm {

// kProbs: what goes to the logits' buffer is e = exp(min(z - ref, kMaxExp)) rounded to Element, the kept chunk's
// probabilities up to each row's scale exp(ref - lse) (the loop's factored backward, loop.py), in place of z.
// The cap keeps e finite in bf16 (it would overflow past ~e^88.7); a row where it bites passed kFlagSum and is
// folded again, and its backward recomputes it. bf16 only: fp16 overflows past e^11 (the host refuses it).
constexpr float kMaxExpLog2 = 80.f * 1.4426950408889634f;

struct StatsRefArguments {
  const int64_t* target = nullptr;
  const float* reference = nullptr;  // [rows] each row's max over the chunks folded before
  float* target_logit = nullptr;
  float* partials = nullptr;  // [rows, tiles, 2]: (ref, sum of exp(z - ref)); a sum past kFlagSum flags the row
  int64_t class_start = 0;
  int64_t tiles = 0;
};

template <class Element, bool kProbs = false>
struct StatsRefCallbacks : TmaCallbacksBase<StatsRefArguments> {
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.target != nullptr && args.reference != nullptr && args.target_logit != nullptr &&
           args.partials != nullptr;
  }

  CUTLASS_HOST_DEVICE StatsRefCallbacks() {}
  CUTLASS_HOST_DEVICE StatsRefCallbacks(Params const& p, SharedStorage const&) : params(p) {}
  Params params;

  // RowF / RowI: register tensors with stride 0 along N (one value per row of the thread, as in
  // grad_tma_gemm.cuh): `sum` is written through every element's index, so each row's elements add into the one
  // register of that row.
  template <class RowF, class RowI, class Coords, class Residue, int kTileN>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RowF ref_, RowF ref_log2e_, RowF sum_, RowI t_, Coords tCcD_,
                                          Residue residue_, Params const& params_, int m0_, int n0_)
        : ref(ref_), ref_log2e(ref_log2e_), sum(sum_), t(t_), tCcD(tCcD_), residue(residue_), params(params_),
          m0(m0_), n0(n0_) {}

    RowF ref;        // the row's reference
    RowF ref_log2e;  // ref log2(e), for exp_minus
    RowF sum;        // the thread's part of sum exp(z - ref)
    RowI t;          // the target's column relative to the thread's first column, or -1 when it is not here
    Coords tCcD;
    Residue residue;
    Params const& params;
    int m0, n0;                // the thread's first row and column in the chunk
    bool warp_targets = true;  // whether a row of any lane of the warp has its target in this tile
    bool cols_full = true;     // whether every column of this tile is inside the chunk

    CUTLASS_DEVICE void begin() {
      using namespace cute;
      Tensor ref_flt = filter_zeros(ref);
      Tensor refl_flt = filter_zeros(ref_log2e);
      Tensor sum_flt = filter_zeros(sum);
      Tensor t_flt = filter_zeros(t);
      Tensor c_flt = filter_zeros(tCcD, ref.stride());
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(ref_flt); ++i) {
        const int r = get<0>(c_flt(i));
        const bool ok = r < get<0>(residue);
        const int row = m0 + r;
        const float m = ok ? params.reference[row] : 0.f;
        ref_flt(i) = m;
        refl_flt(i) = m * kLog2e;
        sum_flt(i) = 0.f;
        // (a target past the chunk's last column would match a column of the zero-filled edge tile)
        const int64_t rel = ok ? params.target[row] - params.class_start - n0 : int64_t(-1);
        t_flt(i) = (rel >= 0 && rel < static_cast<int64_t>(get<1>(residue))) ? static_cast<int>(rel) : -1;
      }
      bool here = false;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(t_flt); ++i) here |= t_flt(i) >= 0 && t_flt(i) < kTileN;
      warp_targets = __any_sync(0xffffffffu, here);
      // The tile's first column: the thread's first one, less its offset in the tile.
      const int tile_n0 = (n0 / kTileN) * kTileN;
      cols_full = tile_n0 + kTileN <= n0 + static_cast<int>(get<1>(residue));
    }

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<Element, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const& acc, int epi_v, int epi_m, int epi_n) {
      using namespace cute;
      Tensor refl_mn = ref_log2e(_, _, _, epi_m, epi_n);
      Tensor sum_mn = sum(_, _, _, epi_m, epi_n);
      Tensor t_mn = t(_, _, _, epi_m, epi_n);
      Tensor c_mn = tCcD(_, _, _, epi_m, epi_n);
      // Rounded as cuBLAS rounds the logits it stores (pairs by one cvt.rn.bf16x2): the values stored and folded.
      const cutlass::Array<Element, FragmentSize> z =
          cutlass::NumericArrayConverter<Element, ElementAccumulator, FragmentSize>{}(acc);
      // Uniform branches: a tile past the chunk's last column masks those columns (the TMA loads' zero fill
      // would add exp(-ref)); a warp holding a target compares columns.
      // Each exponential is added as it comes; kProbs also keeps them for the store. (Two loop forms, as ptxas
      // spills least: the kProbs one for the sums kept in e fills more registers without it, 32 bytes against 80,
      // and without kProbs e costs 88 bytes against 16.)
      [[maybe_unused]] cutlass::Array<float, FragmentSize> e;
      if constexpr (kProbs) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          e[i] = exp2_ftz(::fminf(::fmaf(static_cast<float>(z[i]), kLog2e, -refl_mn(epi_v * FragmentSize + i)),
                                  kMaxExpLog2));
        }
      }
      if (cols_full) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          const int idx = epi_v * FragmentSize + i;
          if constexpr (kProbs) {
            sum_mn(idx) += e[i];
          } else {
            sum_mn(idx) += exp_minus(static_cast<float>(z[i]), refl_mn(idx));
          }
        }
      } else {
        const int cols_left = static_cast<int>(get<1>(residue));
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          const int idx = epi_v * FragmentSize + i;
          const float ei = kProbs ? e[i] : exp_minus(static_cast<float>(z[i]), refl_mn(idx));
          sum_mn(idx) += get<1>(c_mn(idx)) < cols_left ? ei : 0.f;
        }
      }
      if (warp_targets) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          const int idx = epi_v * FragmentSize + i;
          if (get<1>(c_mn(idx)) == t_mn(idx)) params.target_logit[m0 + get<0>(c_mn(idx))] = static_cast<float>(z[i]);
        }
      }
      if constexpr (kProbs) {
        return cutlass::NumericArrayConverter<Element, float, FragmentSize>{}(e);
      } else {
        return z;
      }
    }

    // The quad of lanes holding a row sums its parts (a fixed shuffle order: deterministic); its first lane
    // writes the row's partial (past kFlagSum, the merge kernel's flag).
    CUTLASS_DEVICE void end() {
      using namespace cute;
      Tensor ref_flt = filter_zeros(ref);
      Tensor sum_flt = filter_zeros(sum);
      Tensor c_flt = filter_zeros(tCcD, ref.stride());
      const int tile = n0 / kTileN;
      // (a swizzled tile grid's padding tiles lie wholly past the columns: nothing of theirs is written)
      const bool writer = (threadIdx.x % 4) == 0 && tile < params.tiles;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(sum_flt); ++i) {
        float s = sum_flt(i);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        const int r = get<0>(c_flt(i));
        if (writer && r < get<0>(residue)) {
          const int64_t row = m0 + r;
          reinterpret_cast<float2*>(params.partials)[row * params.tiles + tile] = make_float2(ref_flt(i), s);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    // A column vector (stride 1 along M, 0 along N and L), partitioned like the thread's accumulator subtiles;
    // only its layout is used (the values are loaded in begin()).
    Tensor mRow = make_tensor(make_gmem_ptr(params.reference),
                              make_layout(make_shape(M, N, L), make_stride(_1{}, _0{}, _0{})));
    Tensor tCgRow = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        mRow, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor ref_r = make_tensor_like<float>(tCgRow);
    Tensor refl_r = make_tensor_like<float>(tCgRow);
    Tensor sum_r = make_tensor_like<float>(tCgRow);
    Tensor t_r = make_tensor_like<int>(tCgRow);
    // args.residue_tCcD is (M, N) minus the thread's first coordinate.
    const int m0 = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    constexpr int kTileN = decltype(size<1>(args.tile_shape_mnk))::value;
    return ConsumerStoreCallbacks<decltype(ref_r), decltype(t_r), decltype(args.tCcD), decltype(args.residue_tCcD),
                                  kTileN>(ref_r, refl_r, sum_r, t_r, args.tCcD, args.residue_tCcD, params, m0, n0);
  }
};

template <class Element, Schedule S, bool kProbs = false>
struct StatsRefGemm {
  using Callbacks = StatsRefCallbacks<Element, kProbs>;
  using Gemm = TmaStoreGemm<Element, S, Callbacks>;
  using Device = typename Gemm::Device;

  static typename Device::Arguments arguments(const StatsGemmParams& p) {
    typename Callbacks::Arguments cb;
    cb.target = p.target;
    cb.reference = p.reference;
    cb.target_logit = p.target_logit;
    cb.partials = p.partials;
    cb.class_start = p.class_start;
    cb.tiles = (p.cols + Gemm::kTileCols - 1) / Gemm::kTileCols;
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth, cb, p.logits,
                           p.logits_stride, p.sm_count);
  }
  static size_t workspace_bytes(const StatsGemmParams& p) { return Device::get_workspace_size(arguments(p)); }
  static const char* run(const StatsGemmParams& p, void* workspace, cudaStream_t stream) {
    return launch<Device>(arguments(p), workspace, stream,
                          "CUTLASS cannot implement this statistics GEMM against a reference (alignment of logits?)");
  }
};

}  // namespace gemm
}  // namespace hugehead
