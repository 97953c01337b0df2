// The backward's recompute GEMM whose epilogue writes dLoss/dlogits directly (what chunk_grad_ does in
// place to stored logits), so the logits never make a round trip through HBM before the dX / dW GEMMs read
// the gradient (the GEMM itself: fused_gemm.cuh). Included by one .cu per (dtype, schedule).
#pragma once

#include <cmath>
#include <cstdint>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

// Per element, given the row's final lse, g = dLoss/dloss_row and g_lse (numerics.h's logit_grad, with
// z * (1 / softcap) for the division, as the logits_in_place softcap):
//   (g (p - eps / V - (1 - eps) [j == target] + p * 2 z_loss lse) + g_lse p) * dsoftcap/dz
// with p = exp(c - lse) (exp_minus), c the softcapped logit. Rows with g == g_lse == 0 (ignored) are exact zeros.
template <class Element>
struct GradEpilogue : EpilogueBase<Element> {
  struct Arguments {
    const Element* bias = nullptr;
    const int64_t* target = nullptr;
    const float* lse = nullptr;
    const float* grad_rows = nullptr;
    const float* grad_lse = nullptr;  // or nullptr
    Element* grad_logits = nullptr;
    int64_t grad_stride = 0;
    int64_t class_start = 0;
    float smooth = 0.f;         // label_smoothing / num_classes
    float target_weight = 1.f;  // 1 - label_smoothing
    float z_loss = 0.f;
    float softcap = 0.f;
    float inv_softcap = 0.f;  // 1 / softcap, computed on the host
    bool pairs = false;  // grad_logits rows 4-byte aligned: adjacent columns stored as one 32-bit word
    bool exact = false;  // the accumulator is the logit (GradGemmParams::exact: no bias or softcap)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.target != nullptr && args.lse != nullptr && args.grad_rows != nullptr &&
           args.grad_logits != nullptr;
  }

  CUTLASS_HOST_DEVICE GradEpilogue(Params const& p, typename EpilogueBase<Element>::SharedStorage const& = {})
      : params(p) {}

  // A thread's rows' inputs, loaded before any arithmetic (fused_gemm.cuh says why).
  template <int kRows>
  struct RowInputs {
    float g[kRows], gl[kRows], lse[kRows];
    int64_t target[kRows];
  };

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    check_fragment<FrgLayout, TiledMma>();
    if (tile_past_columns(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl)) return;
    constexpr int kRows = 2 * size<1>(FrgLayout{});
    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const auto tCcD = tile_coordinates(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);
    const auto f = fragment_rows<FrgLayout>(tCcD, problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl);
    RowInputs<kRows> in;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const bool ok = f.row[i] < M;
      in.g[i] = ok ? params.grad_rows[f.row[i]] : 0.f;
      in.gl[i] = (ok && params.grad_lse != nullptr) ? params.grad_lse[f.row[i]] : 0.f;
      in.lse[i] = ok ? params.lse[f.row[i]] : 0.f;
      in.target[i] = ok ? params.target[f.row[i]] : int64_t(-1);
    }
    // Fast paths for the tiles inside the problem, stored in 32-bit words, with the plain loss's gradient
    // (no softcap, z-loss or returned lse: g (p - eps / V), the target's (1 - eps) fixed up apart); every
    // other tile takes a checked path with the whole formula.
    const bool cap = params.softcap > 0.f;
    if (f.full && !cap && params.pairs && params.z_loss == 0.f && params.grad_lse == nullptr) {
      if (params.bias != nullptr) write<true, false, true>(acc, tCcD, f, in, problem_shape_mnkl, blk_shape_MNK);
      else write<true, false, false>(acc, tCcD, f, in, problem_shape_mnkl, blk_shape_MNK);
    } else {
      if (cap) write<false, true, true>(acc, tCcD, f, in, problem_shape_mnkl, blk_shape_MNK);
      else write<false, false, true>(acc, tCcD, f, in, problem_shape_mnkl, blk_shape_MNK);
    }
  }

  // kFull: the tile is inside the problem, params.pairs holds, and there is no softcap, z-loss or grad_lse.
  template <bool kFull, bool kCap, bool kBias, class Acc, class Coords, class Rows, class Inputs, class ProblemShapeMNKL,
            class BlockShapeMNK>
  CUTLASS_DEVICE void write(Acc& acc, Coords const& tCcD, Rows const& f, Inputs const& in,
                            ProblemShapeMNKL const& problem_shape_mnkl, BlockShapeMNK const&) {
    using namespace cute;
    using FrgLayout = typename Acc::layout_type;
    constexpr int kSteps = size<0, 2>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});
    constexpr int kRows = 2 * size<1>(FrgLayout{});
    constexpr int kTileN = size<1>(BlockShapeMNK{});
    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));
    // The softcap stays out of logits_in_place here: its tanh also gives dsoftcap/dz below.
    if (!params.exact) logits_in_place<Element, kFull, false, kBias>(acc, tCcD, N, params.bias, 0.f, 0.f);
    const float cap = params.softcap, inv_cap = params.inv_softcap;

    int t_off[kRows];
    float lse_log2e[kRows];
    float z_term[kRows];
    bool zero_row[kRows];
    Element* out[kRows];  // the row's grad_logits at the thread's first column
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      t_off[i] = target_offset<kTileN>(in.target[i], params.class_start, f.col0);
      z_term[i] = 2.f * params.z_loss * in.lse[i];
      lse_log2e[i] = in.lse[i] * kLog2e;
      zero_row[i] = in.g[i] == 0.f && in.gl[i] == 0.f;
      out[i] = params.grad_logits + static_cast<int64_t>(f.row[i]) * params.grad_stride + f.col0;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int ni = 0; ni < kMmaN; ++ni) {
      CUTLASS_PRAGMA_UNROLL
      for (int st = 0; st < kSteps; ++st) {
        const int col0 = get<1>(tCcD(make_coord(make_coord(0, 0, st), 0, ni)));
        const int offset0 = col0 - f.col0;  // a constant: the fragment's layout is static
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) {
          Element v[2];
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) {
            const float z = acc(make_coord(make_coord(c, i % 2, st), i / 2, ni));
            float cz = z, dcdz = 1.f;
            if constexpr (kCap) {
              const float th = ::tanhf(z * inv_cap);
              cz = cap * th;
              dcdz = 1.f - th * th;
            }
            const float p = exp_minus(cz, lse_log2e[i]);
            float grad;
            if constexpr (kFull) {
              grad = in.g[i] * (p - params.smooth);  // the target's element is rewritten below
            } else {
              float d = p - params.smooth;
              if (offset0 + c == t_off[i]) d -= params.target_weight;
              d += p * z_term[i];
              if constexpr (kCap) {
                grad = in.gl[i] == 0.f ? in.g[i] * (d * dcdz) : (in.g[i] * d + in.gl[i] * p) * dcdz;
              } else {
                grad = in.gl[i] * p + in.g[i] * d;  // = g d exactly when gl is 0
              }
            }
            v[c] = static_cast<Element>(zero_row[i] ? 0.f : grad);
          }
          const uint32_t word = static_cast<uint32_t>(v[0].raw()) | (static_cast<uint32_t>(v[1].raw()) << 16);
          if constexpr (kFull) {
            reinterpret_cast<uint32_t*>(out[i])[offset0 / 2] = word;  // offset0 is even: an immediate offset
          } else {
            if (f.row[i] >= M) continue;
            if (params.pairs && col0 + 1 < N) {
              *reinterpret_cast<uint32_t*>(out[i] + offset0) = word;
            } else {
              if (col0 < N) out[i][offset0] = v[0];
              if (col0 + 1 < N) out[i][offset0 + 1] = v[1];
            }
          }
        }
      }
    }
    if constexpr (kFull) {
      // The target elements (picked under a warp vote, fused_gemm.cuh), rewritten with the same arithmetic
      // as the checked path with z-loss 0 and no grad_lse: g ((p - eps / V) - (1 - eps)). The thread wrote
      // the element above: its own later store wins.
      bool mine[kRows];
      float z_t[kRows];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        mine[i] = holds_offset<kSteps>(tCcD, t_off[i], f.col0, N);
        z_t[i] = 0.f;
      }
      if (pick_at_offsets(acc, tCcD, f.col0, t_off, mine, z_t)) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kRows; ++i) {
          if (!mine[i]) continue;
          const float p = exp_minus(z_t[i], lse_log2e[i]);
          const float grad = in.g[i] * ((p - params.smooth) - params.target_weight);
          out[i][t_off[i]] = static_cast<Element>(zero_row[i] ? 0.f : grad);
        }
      }
    }
  }

  Params params;
};

template <class Element, Schedule S>
struct GradGemm {
  using Gemm = FusedGemm<Element, S, GradEpilogue<Element>>;

  static typename Gemm::Device::Arguments arguments(const GradGemmParams& p) {
    typename GradEpilogue<Element>::Arguments epi;
    epi.bias = static_cast<const Element*>(p.bias);
    epi.target = p.target;
    epi.lse = p.lse;
    epi.grad_rows = p.grad_rows;
    epi.grad_lse = p.grad_lse;
    epi.grad_logits = static_cast<Element*>(p.grad_logits);
    epi.grad_stride = p.grad_stride;
    epi.class_start = p.class_start;
    epi.smooth = static_cast<float>(static_cast<double>(p.label_smoothing) / static_cast<double>(p.num_classes));
    epi.target_weight = 1.f - p.label_smoothing;
    epi.z_loss = p.z_loss;
    epi.softcap = p.softcap;
    epi.inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
    epi.pairs = p.grad_stride % 2 == 0 && reinterpret_cast<uintptr_t>(p.grad_logits) % 4 == 0;
    epi.exact = p.exact;
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth, epi, p.sm_count);
  }
  static size_t workspace_bytes(const GradGemmParams& p) { return Gemm::Device::get_workspace_size(arguments(p)); }
  static const char* run(const GradGemmParams& p, void* workspace, cudaStream_t stream) {
    return Gemm::run(arguments(p), workspace, stream);
  }
};

}  // namespace gemm
}  // namespace hugehead
