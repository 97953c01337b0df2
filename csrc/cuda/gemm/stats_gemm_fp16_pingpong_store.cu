// The statistics GEMM for fp16 inputs that also stores its logits by TMA, pingpong schedule (stats_store_gemm.cuh).
#include "stats_store_gemm.cuh"

HUGEHEAD_STATS_STORE_GEMM_INSTANCE(stats_gemm_fp16_pingpong_store, cutlass::half_t, hugehead::gemm::Schedule::kPingpong)
