// Picks the fused GEMM instantiation for a dtype and schedule (instances.def: each is a generated .cu of its own
// so they compile in parallel; this file includes no CUTLASS header).
#include "hugehead/gemm.h"

#include <cstdint>

namespace hugehead {
namespace gemm {

// The launchers of each instantiation in instances.def (HUGEHEAD_FUSED_GEMM_INSTANCE in fused_gemm.cuh defines them).
#define HUGEHEAD_GEMM(NAME, HEADER, PARAMS, ...)       \
  size_t NAME##_workspace(const PARAMS& p);             \
  const char* NAME##_run(const PARAMS& p, void* workspace, cudaStream_t stream);
#include "instances.def"
#undef HUGEHEAD_GEMM

Schedule default_stats_schedule(int64_t depth) {
  return depth >= kStatsCooperativeDepth ? Schedule::kCooperative : Schedule::kPingpongCluster192;
}

Schedule default_grad_schedule(int64_t depth) {
  return depth >= kStatsCooperativeDepth ? Schedule::kPingpongCluster : Schedule::kPingpongCluster192;
}

bool stats_ref_applies(const StatsGemmParams& p, Schedule asked) {
  return p.reference != nullptr && (p.logits != nullptr || asked == Schedule::kPingpongCluster192) &&
         p.bias == nullptr && !(p.softcap > 0.f) && !p.logit_sum;
}

Schedule stats_schedule_for(Schedule schedule, const StatsGemmParams& p) {
  if (stats_ref_applies(p, schedule)) return Schedule::kPingpongCluster192;  // the TMA kernel's one tile, fold_ref's
  const bool pairs_only_applies = !(p.softcap > 0.f) && !p.logit_sum;
  return schedule == Schedule::kPingpongCluster192 && !pairs_only_applies ? Schedule::kPingpongCluster : schedule;
}

int stats_gemm_tile_cols(Schedule schedule) {
  switch (schedule) {
    case Schedule::kCooperative:
      return 256;
    case Schedule::kPingpongCluster192:
      return 192;
    default:
      return 128;
  }
}

namespace {
struct StatsLaunchers {
  size_t (*workspace)(const StatsGemmParams&);
  const char* (*run)(const StatsGemmParams&, void*, cudaStream_t);
};
#define HUGEHEAD_STATS(NAME) StatsLaunchers{&NAME##_workspace, &NAME##_run}
// After stats_schedule_for, a schedule other than pingpong_cluster_192 is cooperative (the depth's default) or
// pingpong_cluster (what 128 x 192 falls back to).
#define HUGEHEAD_STATS_PICK(KIND)                                                                        \
  if (schedule == Schedule::kCooperative) {                                                              \
    return half ? HUGEHEAD_STATS(KIND##_fp16_cooperative) : HUGEHEAD_STATS(KIND##_bf16_cooperative);     \
  }                                                                                                      \
  return half ? HUGEHEAD_STATS(KIND##_fp16_pingpong_cluster) : HUGEHEAD_STATS(KIND##_bf16_pingpong_cluster);
StatsLaunchers stats_launchers(const StatsGemmParams& p, bool half, Schedule schedule) {
  if (p.logits != nullptr && stats_ref_applies(p, schedule)) {
    if (p.probs) return HUGEHEAD_STATS(stats_gemm_probs_bf16_pingpong_cluster192);  // (bf16 only: the host's check)
    return half ? HUGEHEAD_STATS(stats_gemm_ref_fp16_pingpong_cluster192)
                : HUGEHEAD_STATS(stats_gemm_ref_bf16_pingpong_cluster192);
  }
  // (without logits, a reference that applies leaves the schedule at pingpong_cluster_192: fold_ref below)
  schedule = stats_schedule_for(schedule, p);
  if (schedule == Schedule::kPingpongCluster192) {  // stored logits only as stats_schedule_for allows
    if (p.logits != nullptr) {
      return half ? HUGEHEAD_STATS(stats_gemm_store_fp16_pingpong_cluster192)
                  : HUGEHEAD_STATS(stats_gemm_store_bf16_pingpong_cluster192);
    }
    return half ? HUGEHEAD_STATS(stats_gemm_fp16_pingpong_cluster192)
                : HUGEHEAD_STATS(stats_gemm_bf16_pingpong_cluster192);
  }
  if (p.logits != nullptr) {
    HUGEHEAD_STATS_PICK(stats_gemm_store)
  }
  HUGEHEAD_STATS_PICK(stats_gemm)
}
#undef HUGEHEAD_STATS_PICK
#undef HUGEHEAD_STATS
}  // namespace

size_t stats_gemm_workspace_bytes(const StatsGemmParams& p, bool half, Schedule schedule) {
  return stats_launchers(p, half, schedule).workspace(p);
}

const char* run_stats_gemm(const StatsGemmParams& p, bool half, Schedule schedule, void* workspace,
                           cudaStream_t stream) {
  return stats_launchers(p, half, schedule).run(p, workspace, stream);
}

bool grad_gemm_tma_store_applies(const GradGemmParams& p) {
  // 2-byte elements: TMA wants a 16-byte aligned base and row stride, CUTLASS a row length of whole 16 bytes.
  const bool aligned = reinterpret_cast<uintptr_t>(p.grad_logits) % 16 == 0 && (p.grad_stride * 2) % 16 == 0 &&
                       p.cols % 8 == 0;
  return aligned && p.bias == nullptr && !(p.softcap > 0.f) && p.z_loss == 0.f &&
         p.grad_lse == nullptr;
}

namespace {
// One pick for the workspace query and the launch (as stats_launchers): the TMA store where it applies (128 x 192
// tiles in 64 x 64 epilogue subtiles on pingpong_cluster_192), else the register epilogue, which has no 128 x 192
// instantiation (pingpong_cluster for it). default_grad_schedule gives one of the two cluster schedules.
struct GradLaunchers {
  size_t (*workspace)(const GradGemmParams&);
  const char* (*run)(const GradGemmParams&, void*, cudaStream_t);
};
#define HUGEHEAD_GRAD(NAME) GradLaunchers{&NAME##_workspace, &NAME##_run}
#define HUGEHEAD_GRAD_PICK(KIND) \
  return half ? HUGEHEAD_GRAD(grad_gemm_fp16_##KIND) : HUGEHEAD_GRAD(grad_gemm_bf16_##KIND)
GradLaunchers grad_launchers(const GradGemmParams& p, bool half, Schedule schedule) {
  if (!grad_gemm_tma_store_applies(p)) HUGEHEAD_GRAD_PICK(pingpong_cluster);
  if (schedule == Schedule::kPingpongCluster192) HUGEHEAD_GRAD_PICK(pingpong_cluster192_tma_e64);
  HUGEHEAD_GRAD_PICK(pingpong_cluster_tma);
}
#undef HUGEHEAD_GRAD_PICK
#undef HUGEHEAD_GRAD
}  // namespace

size_t grad_gemm_workspace_bytes(const GradGemmParams& p, bool half, Schedule schedule) {
  return grad_launchers(p, half, schedule).workspace(p);
}

const char* run_grad_gemm(const GradGemmParams& p, bool half, Schedule schedule, void* workspace,
                          cudaStream_t stream) {
  return grad_launchers(p, half, schedule).run(p, workspace, stream);
}

}  // namespace gemm
}  // namespace hugehead
