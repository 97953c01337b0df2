// What crosses from the host entry of the fused GEMMs (csrc/cuda/gemm/gemm_chunk_stats.cu, ATen) to their
// CUTLASS instantiations (csrc/cuda/gemm/stats_gemm_*.cu, no ATen): a plain params struct and the
// launchers. Kept free of both ATen and CUTLASS so each side compiles without the other's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace hugehead {
namespace gemm {

// z = x @ weight^T (+ bias), softcapped, folded per (row, column tile) into partials; the logits are not
// stored unless logits is set (then z, unsoftcapped, also goes there: stats_store_gemm.cuh). x [rows, depth]
// and weight [cols, depth] are K-major (unit stride along depth).
// A partial folded against a reference (StatsGemmParams::reference: stats_ref_gemm.cuh's TMA kernel, stats_gemm.cuh's
// fold_ref; or StatsGemmParams::exact's fold, against the max of its tile's first eight columns) whose sum passes
// this flags its row: 2^80 ~ e^55.5, a logit ~55 above the reference (or +inf: a row
// with no finite reference yet). Sums of this size over a whole vocabulary stay far from float32's overflow, and a
// row's gradient scale exp(ref - lse) far from its underflow. gemm_chunk_stats.cu's merge kernel sees such a partial
// and folds that tile again exactly (with stored probabilities, the row's whole chunk); a partial folded against its
// own tile max never passes it (its sum is at most the tile's width).
constexpr float kFlagSum = 1.2089258196146292e24f;

struct StatsGemmParams {
  const void* x;          // [rows, depth], row stride x_stride elements; bf16 or fp16
  const void* weight;     // [cols, depth], row stride weight_stride elements; x's dtype
  const void* bias;       // [cols] x's dtype, or nullptr
  const int64_t* target;  // [rows] global class ids; a row whose target is in [class_start, +cols) gets
  float* target_logit;    //   target_logit[row] set to its (softcapped) logit, others are left alone
  float* partials;        // [rows, num_col_tiles, 4]: (max, sum of exp(z - max), sum of z, unused), or
                          // [rows, num_col_tiles, 2]: (max, sum of exp(z - max)) where logit_sum is false
  int64_t rows;
  int64_t cols;
  int64_t depth;
  int64_t x_stride;
  int64_t weight_stride;
  int64_t class_start;
  float softcap;  // <= 0: none
  int sm_count;   // SMs the persistent kernel spreads its tiles over
  bool logit_sum = true;       // false: the logit sums (label smoothing's) are not folded; partials of 8 bytes
  void* logits = nullptr;      // [rows, cols] x's dtype, row stride logits_stride (16-byte aligned base and
  int64_t logits_stride = 0;   //   rows, cols a multiple of 8), or nullptr: z stored there too (no softcap)
  // Without bias, softcap or logit sums (stats_ref_applies): fold each (row, tile) against this reference
  // [rows] (the row's max over the chunks folded before) into partials (ref, sum exp(z - ref)) on 128 x 192
  // tiles, no tile max: with logits, stats_ref_gemm.cuh's TMA-stored kernel; without, stats_gemm.cuh's
  // fold_ref. A partial whose sum passes kFlagSum (above) flags its row, which the merge kernel then
  // folds again exactly. nullptr: the fold takes each tile's own max.
  const float* reference = nullptr;
  bool probs = false;  // with reference, bf16: logits gets exp(min(z - ref, 80)) in place of z
  // The float32 accumulator is the logit, not rounded to Element first (no bias, softcap, logit sums or stored
  // logits, on pingpong_cluster_192 whatever the schedule asked: the host's rule; the 128 x 192 fold only, so
  // the other tiles' folds keep their registers); the loop asks it of the forward and the backward
  // (GradGemmParams::exact) together.
  bool exact = false;
};

// z = x @ weight^T (+ bias) turned into dLoss/dlogits in the epilogue (what chunk_grad_ does in place to
// stored logits) and written to grad_logits; the logits themselves are never stored.
struct GradGemmParams {
  const void* x;            // [rows, depth] as in StatsGemmParams
  const void* weight;       // [cols, depth]
  const void* bias;         // [cols] or nullptr
  const int64_t* target;    // [rows] global class ids
  const float* lse;         // [rows] every row's final lse
  const float* grad_rows;   // [rows] dLoss/dloss_row (0 for ignored rows: their gradient is exact zeros)
  const float* grad_lse;    // [rows] gradient reaching a returned lse, or nullptr
  void* grad_logits;        // [rows, cols] x's dtype, row stride grad_stride, column stride 1
  int64_t grad_stride;
  int64_t rows;
  int64_t cols;
  int64_t depth;
  int64_t x_stride;
  int64_t weight_stride;
  int64_t class_start;
  int64_t num_classes;      // V over all shards (label smoothing's eps / V)
  float label_smoothing;
  float z_loss;
  float softcap;  // <= 0: none
  int sm_count;
  bool exact = false;  // as StatsGemmParams::exact (no bias or softcap: the host's rule)
};

// The fused GEMMs' CUTLASS schedules. pingpong_cluster_192: 128 x 192 tiles in 2-CTA clusters, for the gradient
// GEMM's TMA-stored kernel and the statistics GEMM where stats_schedule_for allows; the gradient's register
// epilogue takes pingpong_cluster for it.
enum class Schedule { kCooperative = 1, kPingpongCluster = 2, kPingpongCluster192 = 3 };

// The statistics GEMM's schedule for a depth (K = D): pingpong_cluster_192 below kStatsCooperativeDepth (where
// stats_schedule_for allows, else pingpong_cluster), cooperative from it on, where the mainloop outweighs the
// epilogue and the cooperative 128 x 256 tile's mainloop is the fastest (bench/results hold the A/B).
constexpr int64_t kStatsCooperativeDepth = 2048;
Schedule default_stats_schedule(int64_t depth);

// The gradient GEMM's schedule: pingpong_cluster_192 below kStatsCooperativeDepth (the TMA store's; the register
// epilogue's calls take pingpong_cluster), pingpong_cluster from it on.
Schedule default_grad_schedule(int64_t depth);

// The schedule the statistics GEMM runs for these params when `schedule` is asked: pingpong_cluster_192's
// fold is fold_pairs() without logit sums only (stats_gemm.cuh), so softcap and logit sums (label smoothing)
// take pingpong_cluster. Stored logits go through the schedule's own TMA-stored instantiation.
Schedule stats_schedule_for(Schedule schedule, const StatsGemmParams& p);

// Whether run_stats_gemm folds against p.reference (set) for these params, `asked` the schedule asked for: no
// bias, softcap or logit sums, and stored logits (the TMA kernel) or, without them, asked pingpong_cluster_192
// (its fold_ref: the schedule depths below kStatsCooperativeDepth take by default); stats_schedule_for then gives
// pingpong_cluster_192.
bool stats_ref_applies(const StatsGemmParams& p, Schedule asked);

// Columns per tile of a schedule (the partials' num_col_tiles is ceil(cols / this)), after stats_schedule_for.
int stats_gemm_tile_cols(Schedule schedule);

// Bytes of device workspace CUTLASS's kernel needs for these params (0 for the persistent scheduler).
size_t stats_gemm_workspace_bytes(const StatsGemmParams& p, bool half, Schedule schedule);

// Queue the fused GEMM on stream (the one that also stores the logits where p.logits is set). Returns
// nullptr, or a message saying why CUTLASS refused the problem.
const char* run_stats_gemm(const StatsGemmParams& p, bool half, Schedule schedule, void* workspace,
                           cudaStream_t stream);

// The gradient GEMM (a pingpong schedule): workspace bytes and launch, as for the statistics GEMM. The plain
// loss (no bias, softcap, z-loss or grad_lse) into a 16-byte aligned grad_logits with whole 16-byte rows
// stores through shared memory by TMA (grad_tma_gemm.cuh: grad_gemm_tma_store_applies); every other call
// takes the register epilogue's direct stores (grad_gemm.cuh).
bool grad_gemm_tma_store_applies(const GradGemmParams& p);
size_t grad_gemm_workspace_bytes(const GradGemmParams& p, bool half, Schedule schedule);
const char* run_grad_gemm(const GradGemmParams& p, bool half, Schedule schedule, void* workspace,
                          cudaStream_t stream);

}  // namespace gemm
}  // namespace hugehead
