// The backward's recompute GEMM whose epilogue writes dLoss/dlogits directly (what chunk_grad_ does in
// place to stored logits), so the logits never make a round trip through HBM before the dX / dW GEMMs read
// the gradient (the GEMM itself: fused_gemm.cuh). Included by one .cu per dtype.
#pragma once

#include <cmath>
#include <cstdint>

#include "fused_gemm.cuh"

namespace hugehead {
namespace gemm {

// Per element, given the row's final lse, g = dLoss/dloss_row and g_lse (numerics.h's logit_grad, with
// z * (1 / softcap) for the division, as the logits_in_place softcap):
//   (g (p - eps / V - (1 - eps) [j == target] + p * 2 z_loss lse) + g_lse p) * dsoftcap/dz
// with p = exp(c - lse), c the softcapped logit. Rows with g == g_lse == 0 (ignored) are exact zeros.
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
    bool pairs = false;  // grad_logits rows 4-byte aligned: adjacent columns stored as one 32-bit word
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

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout>& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    check_fragment<FrgLayout, TiledMma>();
    constexpr int kSteps = size<0, 2>(FrgLayout{});
    constexpr int kMmaM = size<1>(FrgLayout{});
    constexpr int kMmaN = size<2>(FrgLayout{});

    const int M = static_cast<int>(get<0>(problem_shape_mnkl));
    const int N = static_cast<int>(get<1>(problem_shape_mnkl));
    const auto tCcD = tile_coordinates(problem_shape_mnkl, blk_shape_MNK, blk_coord_mnkl, tiled_mma, thread_idx);
    // The softcap stays out of logits_in_place here: its tanh also gives dsoftcap/dz below.
    logits_in_place<Element>(acc, tCcD, N, params.bias, 0.f);
    const float cap = params.softcap;
    const float inv_cap = cap > 0.f ? __frcp_rn(cap) : 0.f;

    CUTLASS_PRAGMA_UNROLL
    for (int mi = 0; mi < kMmaM; ++mi) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int row = get<0>(tCcD(make_coord(make_coord(0, r, 0), mi, 0)));
        if (row >= M) continue;  // no shuffles below: lanes may leave
        const float g = params.grad_rows[row];
        const float gl = params.grad_lse == nullptr ? 0.f : params.grad_lse[row];
        const bool zero_row = g == 0.f && gl == 0.f;
        const float lse = params.lse[row];
        const float z_term = 2.f * params.z_loss * lse;
        const int64_t t = params.target[row] - params.class_start;
        Element* out = params.grad_logits + static_cast<int64_t>(row) * params.grad_stride;
        CUTLASS_PRAGMA_UNROLL
        for (int ni = 0; ni < kMmaN; ++ni) {
          CUTLASS_PRAGMA_UNROLL
          for (int st = 0; st < kSteps; ++st) {
            Element v[2];
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              const int col = get<1>(tCcD(make_coord(make_coord(c, r, st), mi, ni)));
              const float z = acc(make_coord(make_coord(c, r, st), mi, ni));
              float cz = z, dcdz = 1.f;
              if (cap > 0.f) {
                const float th = ::tanhf(z * inv_cap);
                cz = cap * th;
                dcdz = 1.f - th * th;
              }
              const float p = __expf(cz - lse);
              float d = p - params.smooth;
              if (col == t) d -= params.target_weight;
              d += p * z_term;
              const float grad = gl == 0.f ? g * (d * dcdz) : (g * d + gl * p) * dcdz;
              v[c] = static_cast<Element>(zero_row ? 0.f : grad);
            }
            const int col0 = get<1>(tCcD(make_coord(make_coord(0, r, st), mi, ni)));
            if (params.pairs && col0 + 1 < N) {
              const uint32_t word = static_cast<uint32_t>(v[0].raw()) | (static_cast<uint32_t>(v[1].raw()) << 16);
              *reinterpret_cast<uint32_t*>(out + col0) = word;
            } else {
              if (col0 < N) out[col0] = v[0];
              if (col0 + 1 < N) out[col0 + 1] = v[1];
            }
          }
        }
      }
    }
  }

  Params params;
};

template <class Element>
struct GradGemm {
  using Gemm = FusedGemm<Element, Schedule::kPingpong, GradEpilogue<Element>>;

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
    epi.pairs = p.grad_stride % 2 == 0 && reinterpret_cast<uintptr_t>(p.grad_logits) % 4 == 0;
    return Gemm::arguments(p.x, p.x_stride, p.weight, p.weight_stride, p.rows, p.cols, p.depth, epi, p.sm_count);
  }
  static size_t workspace_bytes(const GradGemmParams& p) { return Gemm::Device::get_workspace_size(arguments(p)); }
  static const char* run(const GradGemmParams& p, void* workspace, cudaStream_t stream) {
    return Gemm::run(arguments(p), workspace, stream);
  }
};

}  // namespace gemm
}  // namespace hugehead

#define HUGEHEAD_GRAD_GEMM_INSTANCE(NAME, ELEMENT)                                                        \
  namespace hugehead {                                                                                 \
  namespace gemm {                                                                                     \
  size_t NAME##_workspace(const GradGemmParams& p) { return GradGemm<ELEMENT>::workspace_bytes(p); }     \
  const char* NAME##_run(const GradGemmParams& p, void* workspace, cudaStream_t stream) {               \
    return GradGemm<ELEMENT>::run(p, workspace, stream);                                               \
  }                                                                                                    \
  }                                                                                                    \
  }
