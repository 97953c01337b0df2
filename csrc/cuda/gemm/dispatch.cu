// Picks the fused GEMM instantiation for a dtype and schedule (each lives in its own .cu so they
// compile in parallel; this file includes no CUTLASS header).
#include "hugehead/gemm.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace hugehead {
namespace gemm {

// The launchers of each instantiation (HUGEHEAD_FUSED_GEMM_INSTANCE in fused_gemm.cuh defines them).
#define HUGEHEAD_DECLARE_GEMM(NAME, PARAMS)            \
  size_t NAME##_workspace(const PARAMS& p);             \
  const char* NAME##_run(const PARAMS& p, void* workspace, cudaStream_t stream);
HUGEHEAD_DECLARE_GEMM(stats_gemm_bf16_pingpong, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_bf16_cooperative, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_fp16_pingpong, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_fp16_cooperative, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_bf16_pingpong_cluster, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_fp16_pingpong_cluster, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_bf16_pingpong, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_bf16_cooperative, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_fp16_pingpong, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_fp16_cooperative, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_bf16_pingpong_cluster, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_fp16_pingpong_cluster, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_bf16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_fp16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_bf16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_store_fp16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_ref_bf16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_ref_fp16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(stats_gemm_probs_bf16_pingpong_cluster192, StatsGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_pingpong, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_pingpong, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_pingpong_cluster, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_pingpong_cluster, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_pingpong_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_pingpong_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_pingpong_cluster_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_pingpong_cluster_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_pingpong_cluster192_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_pingpong_cluster192_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_pingpong_cluster192_tma_e64, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_pingpong_cluster192_tma_e64, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_bf16_cooperative_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(grad_gemm_fp16_cooperative_tma, GradGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dx_float, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dx_float_alt, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dx_float_pingpong, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dx_float_streamk, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_fp16_dx_float, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dw_store, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dw_store_alt, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dw_store_pingpong, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dw_store_streamk, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_fp16_dw_store, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_bf16_dw_float, DenseGemmParams)
HUGEHEAD_DECLARE_GEMM(dense_gemm_fp16_dw_float, DenseGemmParams)
#undef HUGEHEAD_DECLARE_GEMM

Schedule schedule_from_env(Schedule fallback) {
  const char* v = std::getenv("HUGEHEAD_GEMM_SCHEDULE");
  if (v == nullptr) return fallback;
  if (std::strcmp(v, "cooperative") == 0) return Schedule::kCooperative;
  if (std::strcmp(v, "pingpong_cluster") == 0) return Schedule::kPingpongCluster;
  if (std::strcmp(v, "pingpong_cluster_192") == 0) return Schedule::kPingpongCluster192;
  if (std::strcmp(v, "pingpong") == 0) return Schedule::kPingpong;
  return fallback;
}

Schedule default_stats_schedule(int64_t depth) {
  return depth >= kStatsCooperativeDepth ? Schedule::kCooperative : Schedule::kPingpongCluster192;
}

Schedule default_grad_schedule(int64_t depth) {
  return depth >= kStatsCooperativeDepth ? Schedule::kPingpongCluster : Schedule::kPingpongCluster192;
}

bool mainloop_only_from_env() {
  const char* v = std::getenv("HUGEHEAD_GEMM_MAINLOOP_ONLY");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

bool pdl_from_env() {
  const char* v = std::getenv("HUGEHEAD_GEMM_PDL");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

TileOrder tile_order_from_env() {
  TileOrder order;
  const char* r = std::getenv("HUGEHEAD_GEMM_RASTER");
  if (r != nullptr && std::strcmp(r, "m") == 0) order.raster = 1;
  if (r != nullptr && std::strcmp(r, "n") == 0) order.raster = 2;
  const char* s = std::getenv("HUGEHEAD_GEMM_SWIZZLE");
  if (s != nullptr) {
    const int v = std::atoi(s);
    if (v == 2 || v == 4 || v == 8) order.swizzle = v;
  }
  return order;
}

// How a chunk whose logits are kept stores them (HUGEHEAD_GEMM_STATS_STORE, for A/B runs). Unset or "tma": the
// tile its schedule gives (128 x 192 too: fold_pairs() writes z back into the accumulators for CUTLASS's TMA
// epilogue); "tma128": the 128 x 128 tile's TMA store in place of 128 x 192 (the default before 128 x 192
// stored logits); "direct": the 128 x 192 tile's own 32-bit stores as fold_pairs() packs the pairs.
StatsStore stats_store_from_env() {
  const char* v = std::getenv("HUGEHEAD_GEMM_STATS_STORE");
  if (v != nullptr && std::strcmp(v, "direct") == 0) return StatsStore::kDirect;
  if (v != nullptr && std::strcmp(v, "tma128") == 0) return StatsStore::kTma128;
  return StatsStore::kTma;
}

bool stats_ref_applies(const StatsGemmParams& p, Schedule asked) {
  const char* v = std::getenv("HUGEHEAD_GEMM_STATS_REF");
  return p.reference != nullptr && (p.logits != nullptr || asked == Schedule::kPingpongCluster192) &&
         p.bias == nullptr && !(p.softcap > 0.f) && !p.logit_sum && !(v != nullptr && std::strcmp(v, "0") == 0);
}

bool grad_fold_from_env() {
  const char* v = std::getenv("HUGEHEAD_GEMM_GRAD_FOLD");
  return !(v != nullptr && std::strcmp(v, "0") == 0);
}

bool grad_epi_wide_from_env() {
  const char* v = std::getenv("HUGEHEAD_GEMM_GRAD_EPI");
  return !(v != nullptr && std::strcmp(v, "32") == 0);
}

Schedule stats_schedule_for(Schedule schedule, const StatsGemmParams& p) {
  if (stats_ref_applies(p, schedule)) return Schedule::kPingpongCluster192;  // the TMA kernel's one tile, fold_ref's
  const StatsStore store = stats_store_from_env();
  const bool direct_ok = p.logits_stride % 2 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 4 == 0;
  const bool store_192 = p.logits == nullptr || store == StatsStore::kTma || (store == StatsStore::kDirect && direct_ok);
  const bool pairs_only_applies = store_192 && !(p.softcap > 0.f) && !p.logit_sum;
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
#define HUGEHEAD_STATS_PICK(KIND)                                                                        \
  switch (schedule) {                                                                                    \
    case Schedule::kPingpongCluster:                                                                     \
      return half ? HUGEHEAD_STATS(KIND##_fp16_pingpong_cluster) : HUGEHEAD_STATS(KIND##_bf16_pingpong_cluster); \
    case Schedule::kCooperative:                                                                         \
      return half ? HUGEHEAD_STATS(KIND##_fp16_cooperative) : HUGEHEAD_STATS(KIND##_bf16_cooperative);   \
    default:                                                                                             \
      return half ? HUGEHEAD_STATS(KIND##_fp16_pingpong) : HUGEHEAD_STATS(KIND##_bf16_pingpong);         \
  }
StatsLaunchers stats_launchers(const StatsGemmParams& p, bool half, Schedule schedule) {
  if (p.logits != nullptr && stats_ref_applies(p, schedule)) {
    if (p.probs) return HUGEHEAD_STATS(stats_gemm_probs_bf16_pingpong_cluster192);  // (bf16 only: the host's check)
    return half ? HUGEHEAD_STATS(stats_gemm_ref_fp16_pingpong_cluster192)
                : HUGEHEAD_STATS(stats_gemm_ref_bf16_pingpong_cluster192);
  }
  // (without logits, a reference that applies leaves the schedule at pingpong_cluster_192: fold_ref below)
  schedule = stats_schedule_for(schedule, p);
  if (schedule == Schedule::kPingpongCluster192) {  // stored logits only as stats_schedule_for allows
    if (p.logits != nullptr && stats_store_from_env() == StatsStore::kTma) {
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
  return aligned && !p.mainloop_only && p.bias == nullptr && !(p.softcap > 0.f) && p.z_loss == 0.f &&
         p.grad_lse == nullptr;
}

GradStore grad_store_from_env() {
  const char* v = std::getenv("HUGEHEAD_GEMM_GRAD_STORE");
  if (v != nullptr && std::strcmp(v, "direct") == 0) return GradStore::kDirect;
  if (v != nullptr && std::strcmp(v, "tma") == 0) return GradStore::kTma;
  return GradStore::kAuto;
}

namespace {
bool stores_by_tma(const GradGemmParams& p) {
  const GradStore store = grad_store_from_env();
  return store != GradStore::kDirect && grad_gemm_tma_store_applies(p);
}

// One pick for the workspace query and the launch (as stats_launchers): the register epilogue has no
// cooperative instantiation (pingpong for it) and no 128 x 192 one (pingpong_cluster for it).
struct GradLaunchers {
  size_t (*workspace)(const GradGemmParams&);
  const char* (*run)(const GradGemmParams&, void*, cudaStream_t);
};
#define HUGEHEAD_GRAD(NAME) GradLaunchers{&NAME##_workspace, &NAME##_run}
#define HUGEHEAD_GRAD_PICK(KIND) \
  return half ? HUGEHEAD_GRAD(grad_gemm_fp16_##KIND) : HUGEHEAD_GRAD(grad_gemm_bf16_##KIND)
GradLaunchers grad_launchers(const GradGemmParams& p, bool half, Schedule schedule) {
  const bool tma = stores_by_tma(p);
  switch (schedule) {
    case Schedule::kCooperative:
      if (tma) HUGEHEAD_GRAD_PICK(cooperative_tma);
      HUGEHEAD_GRAD_PICK(pingpong);
    case Schedule::kPingpongCluster192:
      if (tma && grad_epi_wide_from_env()) HUGEHEAD_GRAD_PICK(pingpong_cluster192_tma_e64);
      if (tma) HUGEHEAD_GRAD_PICK(pingpong_cluster192_tma);
      HUGEHEAD_GRAD_PICK(pingpong_cluster);
    case Schedule::kPingpongCluster:
      if (tma) HUGEHEAD_GRAD_PICK(pingpong_cluster_tma);
      HUGEHEAD_GRAD_PICK(pingpong_cluster);
    default:
      if (tma) HUGEHEAD_GRAD_PICK(pingpong_tma);
      HUGEHEAD_GRAD_PICK(pingpong);
  }
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

DenseConfig dense_config_from_env() {
  // Unset or "cutlass": the persistent scheduler's tiles (what the loop runs when hugehead/ops.py's
  // DENSE_GEMM_DEFAULT takes ours); the others for A/B runs.
  const char* v = std::getenv("HUGEHEAD_GEMM_DENSE");
  if (v == nullptr) return DenseConfig::kDefault;
  if (std::strcmp(v, "streamk") == 0) return DenseConfig::kStreamK;
  if (std::strcmp(v, "alternate") == 0) return DenseConfig::kAlternate;
  if (std::strcmp(v, "pingpong") == 0) return DenseConfig::kPingpong;
  return DenseConfig::kDefault;
}

namespace {
struct DenseLaunchers {
  size_t (*workspace)(const DenseGemmParams&);
  const char* (*run)(const DenseGemmParams&, void*, cudaStream_t);
};
#define HUGEHEAD_DENSE(NAME) DenseLaunchers{&NAME##_workspace, &NAME##_run}
DenseLaunchers dense_launchers(const DenseGemmParams& p, bool half, DenseKind kind, DenseConfig config) {
  const bool alt = config == DenseConfig::kAlternate && !half;
  const bool pingpong = config == DenseConfig::kPingpong && !half;
  const bool streamk = config == DenseConfig::kStreamK && !half;
  if (kind == DenseKind::kDx) {
    if (half) return HUGEHEAD_DENSE(dense_gemm_fp16_dx_float);
    if (pingpong) return HUGEHEAD_DENSE(dense_gemm_bf16_dx_float_pingpong);
    if (streamk) return HUGEHEAD_DENSE(dense_gemm_bf16_dx_float_streamk);
    return alt ? HUGEHEAD_DENSE(dense_gemm_bf16_dx_float_alt) : HUGEHEAD_DENSE(dense_gemm_bf16_dx_float);
  }
  if (p.out_float) return half ? HUGEHEAD_DENSE(dense_gemm_fp16_dw_float) : HUGEHEAD_DENSE(dense_gemm_bf16_dw_float);
  if (half) return HUGEHEAD_DENSE(dense_gemm_fp16_dw_store);
  if (pingpong) return HUGEHEAD_DENSE(dense_gemm_bf16_dw_store_pingpong);
  if (streamk) return HUGEHEAD_DENSE(dense_gemm_bf16_dw_store_streamk);
  return alt ? HUGEHEAD_DENSE(dense_gemm_bf16_dw_store_alt) : HUGEHEAD_DENSE(dense_gemm_bf16_dw_store);
}
#undef HUGEHEAD_DENSE
}  // namespace

size_t dense_gemm_workspace_bytes(const DenseGemmParams& p, bool half, DenseKind kind, DenseConfig config) {
  return dense_launchers(p, half, kind, config).workspace(p);
}

const char* run_dense_gemm(const DenseGemmParams& p, bool half, DenseKind kind, DenseConfig config, void* workspace,
                           cudaStream_t stream) {
  return dense_launchers(p, half, kind, config).run(p, workspace, stream);
}

}  // namespace gemm
}  // namespace hugehead
