// CUDA implementation of hugehead::gemm_chunk_stats_ (CUDA builds with CUTLASS only): the statistics GEMM
// (stats_gemm.cuh) folds z = x W_c^T + b_c into one partial (max, sum-exp, logit sum) per (row, column tile)
// and writes the target logits; a merge kernel then folds each row's partials, in tile order, into the
// running statistics exactly as chunk_stats_ folds a chunk: lse_merge into (row_max, row_sumexp), += into
// logit_sum. The logits never reach global memory, unless logits is given: then the same GEMM also stores
// them there (stats_store_gemm.cuh), for a chunk whose logits are kept.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "hugehead/common.h"
#include "hugehead/cuda_utils.cuh"
#include "hugehead/gemm.h"
#include "operand_checks.h"

namespace hugehead {
namespace {

constexpr int kMergeThreads = 256;
constexpr int kRowsPerBlock = kMergeThreads / cuda::kWarp;

// One warp per row: lanes fold tiles lane, lane + 32, ... then a fixed shuffle tree: deterministic. kSum:
// partials of (max, sum, logit sum, unused) folding logit_sum too; else (max, sum) partials of 8 bytes.
template <bool kSum>
__global__ void __launch_bounds__(kMergeThreads)
    merge_partials_kernel(const float* __restrict__ partials, int64_t rows, int64_t tiles, float* row_max,
                          float* row_sumexp, float* logit_sum) {
  using Part = std::conditional_t<kSum, float4, float2>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched with PDL (gemm.h's pdl_from_env): the GEMM before it may still be running; a no-op otherwise.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / cuda::kWarp;
  const int lane = threadIdx.x % cuda::kWarp;
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  float m = neg_inf<float>(), s = 0.f, sum = 0.f;
  // kLoads of a lane's partials in flight before it folds them (in the same order, j = lane, lane + 32, ...):
  // at 16384 rows a chunk's 86 column tiles are three loads a lane, which one at a time left the merge
  // latency-bound (~13 us a chunk against ~4 us for its 11 MB).
  constexpr int kLoads = 4;
  const Part* base = reinterpret_cast<const Part*>(partials) + row * tiles;
  for (int64_t j0 = lane; j0 < tiles; j0 += kLoads * cuda::kWarp) {
    Part part[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t j = j0 + u * cuda::kWarp;
      if (j < tiles) part[u] = base[j];
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (j0 + u * cuda::kWarp >= tiles) break;
      lse_merge(m, s, part[u].x, part[u].y);
      if constexpr (kSum) sum += part[u].z;
    }
  }
  cuda::warp_reduce_lse(m, s, sum);
  if (lane == 0) {
    lse_merge(row_max[row], row_sumexp[row], m, s);
    if constexpr (kSum) logit_sum[row] += sum;
  }
}

// The rows the reference kernel flagged (stats_ref_gemm.cuh: a partial past kFlagSum), each folded again
// exactly: one warp a row recomputes its logits tile by tile (a float32 dot over the depth in a fixed lane order,
// rounded once to scalar_t as the GEMM's are) and overwrites the row's partials with each tile's (max, sum
// exp(z - max)), so the merge after it folds them as any. Unflagged rows return at once (the common case: one
// load a warp).
// probs (the stored values are exp(min(z - reference, 80))): the row's stored values are rewritten as
// exp(z - M) with M its max over the chunk, and reference[row] = M, the scale the backward reads for this chunk.
template <typename scalar_t>
__device__ __forceinline__ float row_logit(const scalar_t* xr, const scalar_t* wr, int64_t depth, int lane) {
  float acc = 0.f;
  for (int64_t k = lane; k < depth; k += cuda::kWarp) acc += static_cast<float>(xr[k]) * static_cast<float>(wr[k]);
#pragma unroll
  for (int o = cuda::kWarp / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return static_cast<float>(static_cast<scalar_t>(acc));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kMergeThreads)
    fix_flagged_rows_kernel(const scalar_t* __restrict__ x, int64_t x_stride, const scalar_t* __restrict__ weight,
                            int64_t weight_stride, int64_t rows, int64_t cols, int64_t depth, int64_t tile_cols,
                            int64_t tiles, const int* __restrict__ flags, float* partials, scalar_t* probs,
                            int64_t probs_stride, float* reference) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / cuda::kWarp;
  const int lane = threadIdx.x % cuda::kWarp;
  if (row >= rows || flags[row] == 0) return;  // whole warps leave together
  const scalar_t* xr = x + row * x_stride;
  float2* part = reinterpret_cast<float2*>(partials) + row * tiles;
  float row_max = neg_inf<float>();
  for (int64_t t = 0; t < tiles; ++t) {
    float m = neg_inf<float>(), s = 0.f;
    const int64_t j1 = (t + 1) * tile_cols < cols ? (t + 1) * tile_cols : cols;
    for (int64_t j = t * tile_cols; j < j1; ++j) lse_merge(m, s, row_logit(xr, weight + j * weight_stride, depth, lane), 1.f);
    if (lane == 0) part[t] = make_float2(m, s);
    row_max = m > row_max ? m : row_max;
  }
  if (probs == nullptr) return;
  for (int64_t j = 0; j < cols; ++j) {
    const float z = row_logit(xr, weight + j * weight_stride, depth, lane);
    if (lane == 0) probs[row * probs_stride + j] = static_cast<scalar_t>(::expf(z - row_max));
  }
  if (lane == 0) reference[row] = row_max;
}

void gemm_chunk_stats_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const at::Tensor& target, int64_t class_start, double softcap, const at::Tensor& row_max,
                           const at::Tensor& row_sumexp, const at::Tensor& target_logit,
                           const at::Tensor& logit_sum, bool with_logit_sum,
                           const std::optional<at::Tensor>& logits, const std::optional<at::Tensor>& reference,
                           bool probs) {
  check_gemm_operands(x, weight, bias, "gemm_chunk_stats_");
  if (logits.has_value()) {
    const at::Tensor& z = *logits;
    TORCH_CHECK(z.scalar_type() == x.scalar_type(), "hugehead: logits must be ", x.scalar_type(), ", got ",
                z.scalar_type());
    TORCH_CHECK(z.device() == x.device(), "hugehead: logits are on ", z.device(), " but x is on ", x.device());
    TORCH_CHECK(z.dim() == 2 && z.size(0) == x.size(0) && z.size(1) == weight.size(0),
                "hugehead: logits must have shape [", x.size(0), ", ", weight.size(0), "], got ", z.sizes());
    check_k_major(z, "logits");  // TMA stores them: the loads' layout rules
    TORCH_CHECK(z.size(1) % 8 == 0, "hugehead: gemm_chunk_stats_ stores logits by TMA: their column count and row "
                "stride must be multiples of 8 (whole 16-byte rows), got ", z.size(1), " columns");
    TORCH_CHECK(!(softcap > 0.0), "hugehead: gemm_chunk_stats_ stores logits only without softcap (kept logits "
                "are stored uncapped; softcap ", softcap, " given)");
  }
  // x stands in for the logits chunk: its row count, device and the state's accumulation dtype.
  check_chunk_rows(x, target,
                   {{"row_max", &row_max}, {"row_sumexp", &row_sumexp},
                    {"target_logit", &target_logit}, {"logit_sum", &logit_sum}});
  const int64_t rows = x.size(0), cols = weight.size(0), depth = x.size(1);
  if (rows == 0 || cols == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  gemm::StatsGemmParams p{x.data_ptr(), weight.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr,
                          target.data_ptr<int64_t>(), target_logit.data_ptr<float>(), /*partials=*/nullptr,
                          rows, cols, depth, x.stride(0), weight.stride(0), class_start,
                          static_cast<float>(softcap), at::cuda::getCurrentDeviceProperties()->multiProcessorCount};
  p.logit_sum = with_logit_sum;
  if (logits.has_value()) {
    p.logits = logits->data_ptr();
    p.logits_stride = logits->stride(0);
  } else {
    p.mainloop_only = gemm::mainloop_only_from_env();  // (benchmarks: the stored logits are always written)
  }
  at::Tensor flags;
  if (reference.has_value()) {
    const at::Tensor& ref = *reference;
    TORCH_CHECK(ref.scalar_type() == at::kFloat && ref.device() == x.device() && ref.dim() == 1 &&
                    ref.size(0) == x.size(0) && ref.stride(0) == 1,
                "hugehead: gemm_chunk_stats_'s reference must be a contiguous float32 [", x.size(0), "] on ",
                x.device(), ", got ", ref.scalar_type(), " ", ref.sizes(), " on ", ref.device());
    TORCH_CHECK(!probs || (logits.has_value() && x.scalar_type() == at::kBFloat16 && !bias.has_value() &&
                           !with_logit_sum),
                "hugehead: gemm_chunk_stats_ stores probabilities (probs=True) only for bf16 logits, without bias "
                "or logit sums");
    p.reference = ref.data_ptr<float>();
    p.probs = probs;
    if (gemm::stats_ref_applies(p)) {
      flags = at::zeros({rows}, x.options().dtype(at::kInt));
      p.flags = flags.data_ptr<int>();
    } else {
      TORCH_CHECK(!probs, "hugehead: gemm_chunk_stats_ with probs=True needs the reference kernel "
                  "(HUGEHEAD_GEMM_STATS_REF=0 turns it off)");
      p.reference = nullptr;
    }
  } else {
    TORCH_CHECK(!probs, "hugehead: gemm_chunk_stats_ with probs=True needs a reference");
  }
  const gemm::Schedule schedule =
      gemm::stats_schedule_for(gemm::schedule_from_env(gemm::default_stats_schedule(depth)), p);
  const int64_t tile_cols = gemm::stats_gemm_tile_cols(schedule);
  const int64_t tiles = (cols + tile_cols - 1) / tile_cols;
  at::Tensor partials = at::empty({rows, tiles, with_logit_sum ? 4 : 2}, x.options().dtype(at::kFloat));
  p.partials = partials.data_ptr<float>();
  const bool half = x.scalar_type() == at::kHalf;
  const size_t ws_bytes = gemm::stats_gemm_workspace_bytes(p, half, schedule);
  at::Tensor workspace;
  if (ws_bytes > 0) workspace = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const char* error = gemm::run_stats_gemm(p, half, schedule, ws_bytes > 0 ? workspace.data_ptr() : nullptr, stream);
  TORCH_CHECK(error == nullptr, "hugehead: ", error == nullptr ? "" : error);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto blocks = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  if (p.flags != nullptr) {
    auto fix = [&](auto element) {
      using scalar_t = decltype(element);
      fix_flagged_rows_kernel<scalar_t><<<blocks, kMergeThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(), weight.stride(0), rows, cols, depth,
          tile_cols, tiles, p.flags, partials.data_ptr<float>(),
          p.probs ? static_cast<scalar_t*>(logits->data_ptr()) : nullptr, p.probs ? logits->stride(0) : 0,
          p.probs ? reference->data_ptr<float>() : nullptr);
    };
    if (half) {
      fix(c10::Half{});
    } else {
      fix(c10::BFloat16{});
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const auto merge = with_logit_sum ? merge_partials_kernel<true> : merge_partials_kernel<false>;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kMergeThreads);
  config.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  if (gemm::pdl_from_env()) {
    config.attrs = &pdl;
    config.numAttrs = 1;
  }
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, merge, static_cast<const float*>(partials.data_ptr<float>()), rows,
                                    tiles, row_max.data_ptr<float>(), row_sumexp.data_ptr<float>(),
                                    with_logit_sum ? logit_sum.data_ptr<float>() : nullptr));
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("gemm_chunk_stats_", &gemm_chunk_stats_cuda); }

}  // namespace hugehead
