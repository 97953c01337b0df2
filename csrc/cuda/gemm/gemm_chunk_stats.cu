// CUDA implementation of hugehead::gemm_chunk_stats_ (CUDA builds with CUTLASS only): the statistics GEMM
// (stats_gemm.cuh) folds z = x W_c^T + b_c into one partial (max, sum-exp, logit sum) per (row, column tile)
// and writes the target logits; a merge kernel then folds each row's partials, in tile order, into the
// running statistics exactly as chunk_stats_ folds a chunk: lse_merge into (row_max, row_sumexp), += into
// logit_sum. The logits never reach global memory, unless logits is given: then the same GEMM also stores
// them there (stats_store_gemm.cuh), for a chunk whose logits are kept.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
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

// A flagged tile or row folded again exactly (the merge kernel's rare path; gemm.h's kFlagSum): what it needs of
// the GEMM's operands. probs: the stored values (exp(min(z - reference, 80))) are rewritten as exp(z - M), M the
// row's max over the chunk, and reference[row] = M, the scale the backward reads for this chunk.
template <typename scalar_t>
struct FixArgs {
  const scalar_t* x = nullptr;  // nullptr: no partial folds against a reference (none can pass kFlagSum)
  int64_t x_stride = 0;
  const scalar_t* weight = nullptr;
  int64_t weight_stride = 0;
  int64_t cols = 0;
  int64_t depth = 0;
  int64_t tile_cols = 0;
  scalar_t* probs = nullptr;
  int64_t probs_stride = 0;
  float* reference = nullptr;
  bool exact = false;  // the logits as the float32 dot gives them (StatsGemmParams::exact), else rounded
};

// A float32 dot over the depth in a fixed lane order (every lane gets the same bits), rounded once to scalar_t as
// the GEMM's logits are (unless exact).
template <typename scalar_t>
__device__ __forceinline__ float row_logit(const scalar_t* xr, const scalar_t* wr, int64_t depth, int lane,
                                           bool exact) {
  float acc = 0.f;
  for (int64_t k = lane; k < depth; k += cuda::kWarp) acc += static_cast<float>(xr[k]) * static_cast<float>(wr[k]);
#pragma unroll
  for (int o = cuda::kWarp / 2; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return exact ? acc : static_cast<float>(static_cast<scalar_t>(acc));
}

// One column tile of row `row` (columns [j0, j0 + tile_cols) of the chunk) folded as the GEMM's own-max fold would,
// (max, sum exp(z - max)), by the whole warp (slow: one dot at a time; rare). Every lane returns the same.
template <typename scalar_t>
__device__ void fold_tile_exactly(const FixArgs<scalar_t>& fix, int64_t row, int64_t j0, int lane, float& tm,
                                  float& ts) {
  const scalar_t* xr = fix.x + row * fix.x_stride;
  tm = neg_inf<float>();
  ts = 0.f;
  const int64_t j1 = j0 + fix.tile_cols < fix.cols ? j0 + fix.tile_cols : fix.cols;
  for (int64_t j = j0; j < j1; ++j) lse_merge(tm, ts, row_logit(xr, fix.weight + j * fix.weight_stride, fix.depth, lane, fix.exact), 1.f);
}

// Row `row`'s whole chunk folded tile by tile (fold_tile_exactly, then the tiles in order), its stored values
// rewritten against the row's max over the chunk (probs: the row's reference moves there). Every lane returns the
// same.
template <typename scalar_t>
__device__ void fold_row_exactly(const FixArgs<scalar_t>& fix, int64_t row, int lane, float& m, float& s) {
  const scalar_t* xr = fix.x + row * fix.x_stride;
  m = neg_inf<float>();
  s = 0.f;
  float row_top = neg_inf<float>();
  for (int64_t j0 = 0; j0 < fix.cols; j0 += fix.tile_cols) {
    float tm, ts;
    fold_tile_exactly(fix, row, j0, lane, tm, ts);
    lse_merge(m, s, tm, ts);
    row_top = tm > row_top ? tm : row_top;
  }
  if (fix.probs == nullptr) return;
  for (int64_t j = 0; j < fix.cols; ++j) {
    const float z = row_logit(xr, fix.weight + j * fix.weight_stride, fix.depth, lane, fix.exact);
    if (lane == 0) fix.probs[row * fix.probs_stride + j] = static_cast<scalar_t>(::expf(z - row_top));
  }
  if (lane == 0) fix.reference[row] = row_top;
}

// One warp per row: lanes fold tiles lane, lane + 32, ... then a fixed shuffle tree: deterministic. kSum:
// partials of (max, sum, logit sum, unused) folding logit_sum too; else (max, sum) partials of 8 bytes. A partial
// past kFlagSum (folded against a reference, or by the exact fold against its tile's sampled max: gemm.h) is not
// merged: that tile is folded again exactly (fold_tile_exactly: 192 dots, ~us) and merged by the lane that held it,
// after its other tiles; with stored probabilities the row's whole chunk is (fold_row_exactly: its values and
// reference move to the chunk's max). Every other row pays one compare a partial for that.
template <typename scalar_t, bool kSum>
__global__ void __launch_bounds__(kMergeThreads)
    merge_partials_kernel(const float* __restrict__ partials, int64_t rows, int64_t tiles, float* row_max,
                          float* row_sumexp, float* logit_sum, FixArgs<scalar_t> fix) {
  using Part = std::conditional_t<kSum, float4, float2>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / cuda::kWarp;
  const int lane = threadIdx.x % cuda::kWarp;
  if (row >= rows) return;  // whole warps leave together: the shuffles below stay full-warp
  float m = neg_inf<float>(), s = 0.f, sum = 0.f;
  bool flagged = false;
  // kLoads of a lane's partials in flight before it folds them (in the same order, j = lane, lane + 32, ...):
  // a wide chunk's column tiles are several loads a lane, which one at a time leave the merge latency-bound
  // rather than bandwidth-bound. 8 float2 loads a lane keep the 48 registers (sm_90a ptxas) and double
  // the bytes in flight; the float4 instance keeps 4. The two instances are the same bits: the same merges in
  // the same order, and lse_merge rounds each product (numerics.h), so nvcc cannot contract one of them into an
  // FFMA differently in the two instances and make their sums of exps differ.
  constexpr int kLoads = kSum ? 4 : 8;
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
      const bool flag = fix.x != nullptr && part[u].y > gemm::kFlagSum;  // (NaN sums merge: a NaN lse, as it should)
      flagged |= flag;
      if (!flag) lse_merge(m, s, part[u].x, part[u].y);
      if constexpr (kSum) sum += part[u].z;
    }
  }
  if (fix.x != nullptr && __any_sync(0xffffffffu, flagged)) {  // (no logit sums here: those folds have none)
    if (fix.probs != nullptr) {
      fold_row_exactly(fix, row, lane, m, s);
      if (lane == 0) lse_merge(row_max[row], row_sumexp[row], m, s);
      return;
    }
    for (int64_t j0 = 0; j0 < tiles; j0 += cuda::kWarp) {  // the flagged tiles, 32 at a time, in order
      const int64_t j = j0 + lane;
      unsigned mask = __ballot_sync(0xffffffffu, j < tiles && base[j].y > gemm::kFlagSum);
      while (mask != 0u) {
        const int b = __ffs(mask) - 1;
        mask &= mask - 1u;
        float tm, ts;
        fold_tile_exactly(fix, row, (j0 + b) * fix.tile_cols, lane, tm, ts);
        if (lane == b) lse_merge(m, s, tm, ts);
      }
    }
  }
  cuda::warp_reduce_lse(m, s, sum);
  if (lane == 0) {
    lse_merge(row_max[row], row_sumexp[row], m, s);
    if constexpr (kSum) logit_sum[row] += sum;
  }
}

void gemm_chunk_stats_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           const at::Tensor& target, int64_t class_start, double softcap, const at::Tensor& row_max,
                           const at::Tensor& row_sumexp, const at::Tensor& target_logit,
                           const at::Tensor& logit_sum, bool with_logit_sum,
                           const std::optional<at::Tensor>& logits, const std::optional<at::Tensor>& reference,
                           bool probs, bool exact) {
  check_gemm_operands(x, weight, bias, "gemm_chunk_stats_");
  TORCH_CHECK(!exact || (!bias.has_value() && !(softcap > 0.0) && !logits.has_value() && !with_logit_sum),
              "hugehead: gemm_chunk_stats_ with exact=True takes no bias, softcap, logit sums or stored logits (the "
              "float32 accumulator is the logit only in the 128 x 192 fold without them)");
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
  p.exact = exact;
  if (logits.has_value()) {
    p.logits = logits->data_ptr();
    p.logits_stride = logits->stride(0);
  }
  // The schedule asked for (the depth's): where it is pingpong_cluster_192, a reference applies without stored
  // logits too (fold_ref). exact: the 128 x 192 fold's, whatever the depth (the only one with it).
  const gemm::Schedule asked = exact ? gemm::Schedule::kPingpongCluster192 : gemm::default_stats_schedule(depth);
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
    if (!gemm::stats_ref_applies(p, asked)) {
      TORCH_CHECK(!probs, "hugehead: gemm_chunk_stats_ with probs=True needs the reference kernel, which does not "
                  "apply to these arguments");
      p.reference = nullptr;
    }
  } else {
    TORCH_CHECK(!probs, "hugehead: gemm_chunk_stats_ with probs=True needs a reference");
  }
  const gemm::Schedule schedule = gemm::stats_schedule_for(asked, p);
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
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  config.blockDim = dim3(kMergeThreads);
  config.stream = stream;
  auto merge = [&](auto element) {
    using scalar_t = decltype(element);
    FixArgs<scalar_t> fix;
    if (p.reference != nullptr || exact) {  // a flagged row is folded again from the operands
      fix.x = x.data_ptr<scalar_t>();
      fix.x_stride = x.stride(0);
      fix.weight = weight.data_ptr<scalar_t>();
      fix.weight_stride = weight.stride(0);
      fix.cols = cols;
      fix.depth = depth;
      fix.tile_cols = tile_cols;
      fix.exact = exact;
      if (p.probs) {
        fix.probs = static_cast<scalar_t*>(logits->data_ptr());
        fix.probs_stride = logits->stride(0);
        fix.reference = reference->data_ptr<float>();
      }
    }
    const auto kernel = with_logit_sum ? merge_partials_kernel<scalar_t, true> : merge_partials_kernel<scalar_t, false>;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<const float*>(partials.data_ptr<float>()), rows,
                                      tiles, row_max.data_ptr<float>(), row_sumexp.data_ptr<float>(),
                                      with_logit_sum ? logit_sum.data_ptr<float>() : nullptr, fix));
  };
  if (half) {
    merge(c10::Half{});
  } else {
    merge(c10::BFloat16{});
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CUDA, m) { m.impl("gemm_chunk_stats_", &gemm_chunk_stats_cuda); }

}  // namespace hugehead
