// What crosses from the host entry of the fused GEMMs (csrc/cuda/gemm/gemm_chunk_stats.cu, ATen) to their
// CUTLASS instantiations (csrc/cuda/gemm/stats_gemm_*.cu, no ATen): a plain params struct and the
// launchers. Kept free of both ATen and CUTLASS so each side compiles without the other's headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace hugehead {
namespace gemm {

// z = x @ weight^T (+ bias), softcapped, folded per (row, column tile) into partials; the logits are
// never stored. x [rows, depth] and weight [cols, depth] are K-major (unit stride along depth).
struct StatsGemmParams {
  const void* x;          // [rows, depth], row stride x_stride elements; bf16 or fp16
  const void* weight;     // [cols, depth], row stride weight_stride elements; x's dtype
  const void* bias;       // [cols] x's dtype, or nullptr
  const int64_t* target;  // [rows] global class ids; a row whose target is in [class_start, +cols) gets
  float* target_logit;    //   target_logit[row] set to its (softcapped) logit, others are left alone
  float* partials;        // [rows, num_col_tiles, 4]: (max, sum of exp(z - max), sum of z, unused)
  int64_t rows;
  int64_t cols;
  int64_t depth;
  int64_t x_stride;
  int64_t weight_stride;
  int64_t class_start;
  float softcap;  // <= 0: none
  int sm_count;   // SMs the persistent kernel spreads its tiles over
};

enum class Schedule { kPingpong = 0, kCooperative = 1 };

// Columns per tile of a schedule (the partials' num_col_tiles is ceil(cols / this)).
int stats_gemm_tile_cols(Schedule schedule);

// Bytes of device workspace CUTLASS's kernel needs for these params (0 for the persistent scheduler).
size_t stats_gemm_workspace_bytes(const StatsGemmParams& p, bool half, Schedule schedule);

// Queue the fused GEMM on stream. Returns nullptr, or a message saying why CUTLASS refused the problem.
const char* run_stats_gemm(const StatsGemmParams& p, bool half, Schedule schedule, void* workspace,
                           cudaStream_t stream);

}  // namespace gemm
}  // namespace hugehead
