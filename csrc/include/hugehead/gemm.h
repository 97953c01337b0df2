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
  bool mainloop_only = false;  // benchmarks only: skip the epilogue (nothing is written), see below
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
  bool mainloop_only = false;
  // The TMA-stored epilogue (grad_gemm_tma_store_applies) without label smoothing: g p as exp(z - lse + log g)
  // for the rows with g > 0 (one multiply an element fewer; not the same bits as g * p, within float32's
  // rounding of the exponent): grad_fold_from_env().
  bool fold_g = false;
  bool exact = false;  // as StatsGemmParams::exact (no bias or softcap: the host's rule)
};

// HUGEHEAD_GEMM_GRAD_FOLD (read per call): unset or 1 folds g into the gradient's exponent where it applies
// (GradGemmParams::fold_g), 0 keeps g * p, the bits of grad_gemm.cuh's epilogue and chunk_grad_ (A/B runs, and
// the tests that compare the paths bitwise).
bool grad_fold_from_env();

// HUGEHEAD_GEMM_GRAD_EPI (read per call): unset (or "64"), the 128 x 192 TMA gradient is stored in 64 x 64 subtiles
// (6 a tile, tma_store_gemm.cuh's WideEpiTile) instead of CUTLASS's 64 x 32 (12): the same values, half the
// epilogue's fences, barriers and TMA store issues. "32": CUTLASS's subtiles (the A/B's other side).
bool grad_epi_wide_from_env();

// HUGEHEAD_GEMM_SCHEDULE=pingpong|pingpong_cluster|pingpong_cluster_192|cooperative picks one (read per call,
// for A/B runs); else default_stats_schedule / default_grad_schedule by depth. pingpong_cluster_192: 128 x 192
// tiles in 2-CTA clusters, for the gradient GEMM's TMA-stored kernel and the statistics GEMM where
// stats_schedule_for allows; the gradient's register epilogue takes pingpong_cluster for it.
enum class Schedule { kPingpong = 0, kCooperative = 1, kPingpongCluster = 2, kPingpongCluster192 = 3 };

// The schedule HUGEHEAD_GEMM_SCHEDULE names, or fallback when it is unset or names none. The gradient GEMM's
// register epilogue has no cooperative instantiation and takes pingpong for it (its TMA store has one).
Schedule schedule_from_env(Schedule fallback);

// The statistics GEMM's default for a depth (K = D): pingpong_cluster_192 below kStatsCooperativeDepth (where
// stats_schedule_for allows, else pingpong_cluster), cooperative from it on, where the mainloop outweighs the
// epilogue. 128 x 192 against 128 x 128 tiles at xc6M (one H200, 096447b, gemm_clocks' 2.5 s soak of a
// 4096 x 65536 chunk at the ~690 W cap): mainloop alone 688 against 665 TFLOP/s, the fused statistics without
// logit sums 653 against 618 (fold()) / 601 (fold_pairs()). Earlier, for 128 x 128 tiles, ms a chunk:
// K = 768 (xc1M, 8192 x 32768) at fae39e7 (bench/bench_gemm.py, 10 calls) pingpong 0.617, pingpong_cluster
// 0.580, cooperative 0.643; under gemm_clocks' two-second soak (194b171, power-capped) pingpong and
// pingpong_cluster both 0.654-0.658 without logit sums, so the step is the same and a forward alone ~6%
// faster in clusters (bench_lce xc1M forward 20.32 -> 19.18 ms). K = 4096 (llama3_4k, 4096 x 65536) at 33bb83c:
// pingpong 3.459, pingpong_cluster 3.026, cooperative 2.927, against cuBLAS + chunk_stats_ 3.009.
constexpr int64_t kStatsCooperativeDepth = 2048;
Schedule default_stats_schedule(int64_t depth);

// The gradient GEMM's default: pingpong_cluster_192 below kStatsCooperativeDepth (the TMA store's; the register
// epilogue's calls take pingpong_cluster), pingpong_cluster from it on (not measured there on 128 x 192).
// At xc6M (one H200, 096447b, the soak above): 636 against 611 TFLOP/s for pingpong_cluster's TMA store; a
// bench/ab_env.py step with both GEMMs on 128 x 192 (rounds taking turns) 230.61 ms against 236.64 on
// 128 x 128, xc6M_16k 934.52 against 945.30 (xc1M's step, the rows plan, runs neither). Earlier (194b171, xc1M)
// pingpong_cluster 0.680 ms a chunk against 0.691 for pingpong.
Schedule default_grad_schedule(int64_t depth);

// HUGEHEAD_GEMM_MAINLOOP_ONLY=1 (benchmarks only, read per call): the fused GEMMs return from their
// epilogue at once and write nothing, so bench/bench_gemm.py can time a schedule's mainloop alone -- the
// floor its epilogue is measured against. The op's outputs are then left as they were.
bool mainloop_only_from_env();

// Programmatic dependent launch (read per call; HUGEHEAD_GEMM_PDL=1 on, unset or 0 off): every GEMM of ours
// and the statistics' merge kernel are launched with cudaLaunchAttributeProgrammaticStreamSerialization, so
// each may be scheduled while the kernel before it in the stream drains instead of after it has completed.
// Each waits (griddepcontrol.wait) before its first global memory access: CUTLASS's producer warps (built with
// CUTLASS_ENABLE_GDC_FOR_SM90) before their first load, everything else of the kernel only after data those
// loads brought; the merge kernel at its start. Results are the same bits either way. Measured (one H200,
// dbd5ce0): steps tie (xc6M_16k 932.8 ms against 934.2, xc6M 231.3 against 231.2): off by default.
bool pdl_from_env();

// The fused GEMMs' persistent tile order (CUTLASS's PersistentTileSchedulerSm90 arguments), for A/B runs
// (read per call; results are the same bits in any order: each tile's partials and gradient have one home, and
// the padding tiles a swizzle adds are skipped, fused_gemm.cuh's tile_past_columns):
// HUGEHEAD_GEMM_RASTER=m|n (consecutive tiles down the rows / along the columns; unset: CUTLASS's heuristic,
// down the rows where there are more column tiles than row tiles, else along the columns) and
// HUGEHEAD_GEMM_SWIZZLE=1|2|4|8 (tiles grouped in stripes that wide; unset: 1).
struct TileOrder {
  int raster = 0;  // 0 heuristic, 1 along M (rows), 2 along N (columns)
  int swizzle = 1;
};
TileOrder tile_order_from_env();

// How the statistics GEMM stores the logits of a kept chunk (HUGEHEAD_GEMM_STATS_STORE, read per call, for
// A/B runs): unset / "tma" the schedule's own tile through CUTLASS's TMA epilogue (on 128 x 192, fold_pairs()
// writes z back into the accumulators first), "tma128" the 128 x 128 tile's TMA store in place of 128 x 192,
// "direct" the 128 x 192 tile's 32-bit stores from fold_pairs() (4-byte aligned pairs; else 128 x 128).
enum class StatsStore { kTma = 0, kTma128 = 1, kDirect = 2 };
StatsStore stats_store_from_env();

// The schedule the statistics GEMM runs for these params when `schedule` is asked: pingpong_cluster_192's
// fold is fold_pairs() without logit sums only (stats_gemm.cuh), so softcap and logit sums (label smoothing)
// take pingpong_cluster, as stored logits do where stats_store_from_env() says so.
Schedule stats_schedule_for(Schedule schedule, const StatsGemmParams& p);

// Whether run_stats_gemm folds against p.reference (set) for these params, `asked` the schedule asked for: no
// bias, softcap or logit sums, and stored logits (the TMA kernel) or, without them, asked pingpong_cluster_192
// (its fold_ref: the schedule depths below kStatsCooperativeDepth take by default). HUGEHEAD_GEMM_STATS_REF=0 in
// the environment, read per call, turns it off for A/B runs. stats_schedule_for then gives pingpong_cluster_192.
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
// takes the register epilogue's direct stores (grad_gemm.cuh). HUGEHEAD_GEMM_GRAD_STORE (read per call, for
// A/B runs and tests): unset = that choice, "direct" = the direct stores everywhere, "tma" = the TMA store or
// an error where it does not apply (gemm_chunk_grad_ raises), so a test knows which path ran.
enum class GradStore { kAuto = 0, kTma = 1, kDirect = 2 };
GradStore grad_store_from_env();
bool grad_gemm_tma_store_applies(const GradGemmParams& p);
size_t grad_gemm_workspace_bytes(const GradGemmParams& p, bool half, Schedule schedule);
const char* run_grad_gemm(const GradGemmParams& p, bool half, Schedule schedule, void* workspace,
                          cudaStream_t stream);

// The backward's dense GEMMs on a chunk's dLoss/dlogits g (dense_gemm.cuh), in place of cuBLAS's:
//   kDx: out [rows, depth] float32 (+)= g [rows, cols] @ b [cols, depth]  (b: the weight chunk)
//   kDw: out [cols, depth] (+)= g^T @ b [rows, depth]                     (b: x); out float32 or g's dtype
// Every operand has unit column stride, a 16-byte aligned base and 16-byte aligned row strides.
enum class DenseKind { kDx = 0, kDw = 1 };
// HUGEHEAD_GEMM_DENSE (read per call): cutlass or unset: the persistent scheduler's tiles; streamk: stream-K;
// alternate / pingpong: other tiles (dense_gemm.cuh's DenseTiles; all but the default bf16 only, and not for a
// float32 dW: those take the default).
enum class DenseConfig { kDefault = 0, kAlternate = 1, kPingpong = 2, kStreamK = 3 };
DenseConfig dense_config_from_env();
struct DenseGemmParams {
  const void* g;  // [rows, cols] bf16 / fp16, row stride g_stride
  int64_t g_stride;
  const void* b;  // kDx: [cols, depth]; kDw: [rows, depth]; g's dtype, row stride b_stride
  int64_t b_stride;
  void* out;      // kDx: [rows, depth] float32; kDw: [cols, depth] float32 or g's dtype; row stride out_stride
  int64_t out_stride;
  int64_t rows;
  int64_t cols;
  int64_t depth;
  bool out_float;   // out is float32 (kDx: always)
  bool accumulate;  // out += (float32 out only), else out =
  int sm_count;
};
size_t dense_gemm_workspace_bytes(const DenseGemmParams& p, bool half, DenseKind kind, DenseConfig config);
const char* run_dense_gemm(const DenseGemmParams& p, bool half, DenseKind kind, DenseConfig config, void* workspace,
                           cudaStream_t stream);

}  // namespace gemm
}  // namespace hugehead
