// Picks the fused GEMM instantiation for a dtype and schedule (each lives in its own .cu so they
// compile in parallel; this file includes no CUTLASS header).
#include "hugehead/gemm.h"

namespace hugehead {
namespace gemm {

#define HUGEHEAD_DECLARE_STATS_GEMM(NAME)                     \
  size_t NAME##_workspace(const StatsGemmParams& p);          \
  const char* NAME##_run(const StatsGemmParams& p, void* workspace, cudaStream_t stream);
HUGEHEAD_DECLARE_STATS_GEMM(stats_gemm_bf16_pingpong)
HUGEHEAD_DECLARE_STATS_GEMM(stats_gemm_bf16_cooperative)
HUGEHEAD_DECLARE_STATS_GEMM(stats_gemm_fp16_pingpong)
HUGEHEAD_DECLARE_STATS_GEMM(stats_gemm_fp16_cooperative)
#undef HUGEHEAD_DECLARE_STATS_GEMM
size_t grad_gemm_bf16_workspace(const GradGemmParams& p);
const char* grad_gemm_bf16_run(const GradGemmParams& p, void* workspace, cudaStream_t stream);
size_t grad_gemm_fp16_workspace(const GradGemmParams& p);
const char* grad_gemm_fp16_run(const GradGemmParams& p, void* workspace, cudaStream_t stream);

int stats_gemm_tile_cols(Schedule schedule) { return schedule == Schedule::kPingpong ? 128 : 256; }

size_t stats_gemm_workspace_bytes(const StatsGemmParams& p, bool half, Schedule schedule) {
  if (schedule == Schedule::kPingpong) {
    return half ? stats_gemm_fp16_pingpong_workspace(p) : stats_gemm_bf16_pingpong_workspace(p);
  }
  return half ? stats_gemm_fp16_cooperative_workspace(p) : stats_gemm_bf16_cooperative_workspace(p);
}

const char* run_stats_gemm(const StatsGemmParams& p, bool half, Schedule schedule, void* workspace,
                           cudaStream_t stream) {
  if (schedule == Schedule::kPingpong) {
    return half ? stats_gemm_fp16_pingpong_run(p, workspace, stream)
                : stats_gemm_bf16_pingpong_run(p, workspace, stream);
  }
  return half ? stats_gemm_fp16_cooperative_run(p, workspace, stream)
              : stats_gemm_bf16_cooperative_run(p, workspace, stream);
}

size_t grad_gemm_workspace_bytes(const GradGemmParams& p, bool half) {
  return half ? grad_gemm_fp16_workspace(p) : grad_gemm_bf16_workspace(p);
}

const char* run_grad_gemm(const GradGemmParams& p, bool half, void* workspace, cudaStream_t stream) {
  return half ? grad_gemm_fp16_run(p, workspace, stream) : grad_gemm_bf16_run(p, workspace, stream);
}

}  // namespace gemm
}  // namespace hugehead
